// Tokenizer::Impl, shared by the files of the tokenizer: load.cpp fills it from tokenizer.json,
// bpe.cpp runs the model over one word, tokenizer.cpp is the public API (encode, decode...).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe_maps.h"
#include "tokenizer/components.h"
#include "tokenizer/tokenizer.h"

namespace llmrt {

struct Tokenizer::Impl {
  // model
  std::vector<std::string> vocab_str;  // by id
  std::vector<uint8_t> vocab_present;
  tokenizer_detail::VocabMap vocab;
  tokenizer_detail::MergeMap merges;
  size_t n_merges = 0;
  bool byte_fallback = false;
  bool ignore_merges = false;
  bool fuse_unk = false;
  int32_t unk_id = -1;
  int32_t byte_ids[256];
  // pipeline
  std::unique_ptr<tokenizer_detail::Normalizer> normalizer;
  std::unique_ptr<tokenizer_detail::PreTokenizer> pre_tokenizer;
  std::unique_ptr<tokenizer_detail::PostProcessor> post_processor;
  std::unique_ptr<tokenizer_detail::Decoder> decoder;
  // added tokens
  std::vector<tokenizer_detail::AddedToken> added;
  std::unordered_map<std::string, int32_t> added_by_content;
  std::unordered_map<int32_t, int> added_by_id;  // id -> index in `added`
  tokenizer_detail::AddedTrie trie_raw, trie_norm;
  int64_t size = 0;
  double load_s = 0;

  // Appends the BPE ids of one pre-tokenized word (bpe.cpp).
  void bpe_word(const std::string& w, std::vector<int32_t>& out) const;
  // The string of an added token or vocabulary entry; *known = false for an unknown id.
  std::string token_str(int32_t id, bool* known) const;
  // Reads tokenizer.json (load.cpp).
  void load(const std::string& path);
};

}  // namespace llmrt
