// SHA-256 (FIPS 180-4), for checking a .pte against the digest the pipeline recorded for it
// (--verify-pte). Small and dependency-free: the runners link no crypto library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace llmrt {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  // The digest as 64 lowercase hex characters; the object is spent afterwards.
  std::string hex_digest();

 private:
  void compress(const uint8_t* block);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;  // bytes hashed so far
};

// The digest of a byte string.
std::string sha256_hex(const std::string& bytes);

// The digest of a file, read in chunks (a program can be gigabytes). Throws std::runtime_error
// naming the file if it cannot be read.
std::string sha256_file_hex(const std::string& path);

}  // namespace llmrt
