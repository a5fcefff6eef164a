// PCRE2 regex (UTF + UCP, JIT when available). pcre2.h stays in regex.cpp (its PCRE2_CODE_UNIT_WIDTH
// must be set before it is included).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace llmrt::tokenizer_detail {

class Regex {
 public:
  // Throws TokenizerError if the pattern does not compile.
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // All non-overlapping matches (start, end) in s, which must be valid UTF-8.
  void find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const;

 private:
  struct Pcre;  // compiled code, match data and JIT stack
  std::unique_ptr<Pcre> pcre_;
};

}  // namespace llmrt::tokenizer_detail
