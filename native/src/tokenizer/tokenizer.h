// A reader for Hugging Face tokenizer.json files (BPE models).
//
// Supported (everything else is refused at load time with a message):
//   model:          BPE (merges as "a b" strings or ["a","b"] pairs, byte_fallback,
//                   unk_token/fuse_unk, ignore_merges)
//   normalizer:     Replace, Prepend, Sequence (or null)
//   pre_tokenizer:  ByteLevel, Split, Metaspace, Digits, Whitespace, WhitespaceSplit,
//                   Sequence (or null)
//   post_processor: TemplateProcessing, ByteLevel, Sequence (or null)
//   decoder:        ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence
// Added tokens are matched in the text first (leftmost-longest), before
// normalization for normalized=false tokens and after it for normalized=true.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace llmrt {

class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Tokenizer {
 public:
  // Throws TokenizerError with a readable message.
  static std::unique_ptr<Tokenizer> from_file(const std::string& path);
  ~Tokenizer();

  // Same ids as HF tokenizers' Tokenizer.encode(text, add_special_tokens=...).ids.
  // Invalid UTF-8 in `text` is replaced with U+FFFD first.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;

  // Raw bytes of the decoded ids (ByteFallback bytes are emitted as they are,
  // so the result may be invalid UTF-8 where HF would print U+FFFD).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  // Bytes contributed by one token in a stream; `first` is true for the first
  // token of the stream (for decoders that strip a leading space).
  std::string decode_token(int32_t id, bool first) const;

  // Id of a token string (added token or model vocabulary), or -1.
  int32_t token_to_id(std::string_view token) const;
  // The token string, or "" for an id the tokenizer does not know.
  std::string id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;

  // Highest id the tokenizer can produce + 1 (model vocab and added tokens).
  int64_t vocab_size() const;
  // The BOS id that the post-processor prepends with add_special_tokens, or -1.
  int32_t bos_id() const;

  // Seconds spent in from_file (reading + parsing + building tables).
  double load_seconds() const;
  size_t num_merges() const;

 private:
  Tokenizer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace llmrt
