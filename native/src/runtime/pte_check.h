// Checks on a .pte file before ExecuTorch sees it: its SHA-256 against a recorded digest
// (--verify-pte), and a cheap look at the header and segment table the loader trusts.
#pragma once

#include <string>

namespace llmrt {

// True for 64 hex digits (either case): a SHA-256 as --verify-pte takes it.
bool is_sha256_hex(const std::string& s);

// spec: a SHA-256 in hex, or "auto" = the record of this file in the manifest.json beside it (the
// pipeline's lower-stage cache entry: outputs[<file name>].sha256). Returns the verified digest.
// Throws ProgramError naming the file, the expected and the actual digest on a mismatch, and the
// manifest on a missing or unreadable record.
std::string verify_pte_digest(const std::string& path, const std::string& spec);

}  // namespace llmrt
