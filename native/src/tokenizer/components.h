// The steps of a tokenizer.json around the BPE model, each built from its JSON object (from_json throws
// TokenizerError for a type this reader does not support): normalizers.cpp and pre_tokenizers.cpp
// prepare the text, post_processors.cpp adds special ids, decoders.cpp turns tokens back into bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tokenizer/pattern.h"

namespace llmrt::tokenizer_detail {

using json = nlohmann::json;

// A Sequence inside a Sequence... is followed by recursion (from_json, apply): a damaged or hostile file
// nested thousands deep would overflow the stack. Real tokenizers nest two or three levels.
constexpr int kMaxNesting = 16;
// Throws TokenizerError if a step nests deeper than kMaxNesting; `what` names the step's kind.
void check_nesting(int depth, const char* what);

// An integer of the file in [lo, hi], else TokenizerError naming `what` (a float, a string or a huge
// number where an id or a count belongs; converting those unchecked is undefined behaviour).
int64_t json_int(const json& v, const char* what, int64_t lo, int64_t hi);
// The same for an optional member of an object, `fallback` if it is absent or null.
int64_t json_int(const json& obj, const char* key, int64_t fallback, const char* what, int64_t lo, int64_t hi);

// GPT-2 byte <-> unicode table used by ByteLevel (pre-tokenizer and decoder).
struct ByteMap {
  std::string enc[256];  // byte -> UTF-8 of its printable char
  std::unordered_map<uint32_t, uint8_t> dec;
  ByteMap();
};
const ByteMap& byte_map();

// A pre-tokenized piece: text plus whether it starts at offset 0 of the input.
struct Word {
  std::string s;
  bool at_start;
};

struct Normalizer {
  enum Kind { kReplace, kPrepend, kSequence } kind;
  Pattern pattern;
  std::string content;
  std::vector<std::unique_ptr<Normalizer>> children;

  static std::unique_ptr<Normalizer> from_json(const json& j, int depth = 0);
  void apply(std::string& s) const;
};

struct PreTokenizer {
  enum Kind { kByteLevel, kSplit, kMetaspace, kSequence } kind;
  // ByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
  // Split (also used for Digits / Whitespace / WhitespaceSplit)
  Pattern pattern;
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  // Metaspace
  std::string replacement;
  std::string prepend_scheme;  // always | first | never
  bool split = true;
  std::vector<std::unique_ptr<PreTokenizer>> children;

  static std::unique_ptr<PreTokenizer> from_json(const json& j, int depth = 0);
  void apply(std::vector<Word>& words) const;
};

// Each works on a list of token strings (bytes).
struct Decoder {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace, kSequence } kind;
  std::string pattern, content;  // Replace; Strip content
  size_t start = 0, stop = 0;    // Strip
  std::string replacement;       // Metaspace
  bool strip_first = true;       // Metaspace
  std::vector<std::unique_ptr<Decoder>> children;

  static std::unique_ptr<Decoder> from_json(const json& j, int depth = 0);
  // at_start: toks[0] is the first token of the whole output.
  // stream: decoding one token of a stream (the end is not known).
  void apply(std::vector<std::string>& toks, bool at_start, bool stream, bool& fused) const;
};

// Ids only (offsets and type ids are not needed here).
struct PostProcessor {
  enum Kind { kTemplate, kNoop, kWrap, kSequence } kind;
  // kTemplate: items: id >= 0 special ids to insert, or -1 for the sequence
  std::vector<std::vector<int32_t>> items;  // each: ids, or empty vector = sequence marker
  std::vector<bool> is_seq;
  std::vector<int32_t> before, after;  // kWrap (Bert/Roberta)
  std::vector<std::unique_ptr<PostProcessor>> children;

  static std::unique_ptr<PostProcessor> from_json(const json& j, int depth = 0);
  void apply(std::vector<int32_t>& ids) const;
  // The largest id the processor inserts, or -1 (the loader checks it against the vocabulary).
  int32_t largest_id() const;
  // The id the processor puts first (the BOS of Tokenizer::bos_id), or -1.
  int32_t leading_special() const;
};

}  // namespace llmrt::tokenizer_detail
