// What the Split-like steps share (Split, Digits, Whitespace, Metaspace pre-tokenizers, the Replace
// normalizer): a pattern that is a literal or a regex, and HF's SplitDelimiterBehavior.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tokenizer/regex.h"

namespace llmrt::tokenizer_detail {

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const std::string& s);

// A pattern for Split-like steps: a literal string or a regex.
struct Pattern {
  std::string literal;
  std::unique_ptr<Regex> regex;

  static Pattern from_json(const nlohmann::json& p, const char* where);
  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const;
};

// Splits s by the matches of pat, with behavior b (and optional invert).
void split_pieces(std::string_view s, const Pattern& pat, Behavior b, bool invert,
                  std::vector<std::pair<size_t, size_t>>& out);

}  // namespace llmrt::tokenizer_detail
