#include "tokenizer/added_tokens.h"

#include <algorithm>
#include <cctype>

#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace llmrt::tokenizer_detail {

namespace {

bool is_unicode_space(uint32_t cp) {
  return cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// HF checks single_word tokens with the Rust regex crate's Unicode \w
// (Alphabetic, M, Nd, Pc, Join_Control); this class is its PCRE2 equivalent.
bool is_word_cp(uint32_t cp) {
  if (cp < 0x80) return std::isalnum(static_cast<int>(cp)) || cp == '_';
  static const Regex word(R"([\p{L}\p{Nl}\p{Nd}\p{M}\p{Pc}\x{200C}\x{200D}])");
  std::string ch;
  utf8_append(ch, cp);
  std::vector<std::pair<size_t, size_t>> m;
  word.find_all(ch, m);
  return !m.empty();
}

}  // namespace

void split_added(const std::string& s, const AddedTrie& trie, const std::vector<AddedToken>& added,
                 bool at_start, std::vector<Piece>& out) {
  if (trie.empty() || s.empty()) {
    out.push_back(Piece{s, -1, at_start});
    return;
  }
  size_t start_offset = 0;
  size_t i = 0;
  while (i < s.size()) {
    auto [tok, len] = trie.longest_at(s, i);
    if (tok < 0) {
      ++i;
      continue;
    }
    const AddedToken& at = added[tok];
    size_t start = i, stop = i + len;
    if (at.single_word) {
      bool ok_left = true, ok_right = true;
      if (start > 0) {
        size_t k = start - 1;
        while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        size_t kk = k;
        ok_left = !is_word_cp(utf8_next(s, kk));
      }
      if (stop < s.size()) {
        size_t kk = stop;
        ok_right = !is_word_cp(utf8_next(s, kk));
      }
      if (!ok_left || !ok_right) {
        i += len;  // like HF: the search resumes after the rejected match
        continue;
      }
    }
    if (at.lstrip) {
      size_t ns = start;
      while (ns > start_offset) {
        size_t k = ns - 1;
        while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        size_t kk = k;
        if (!is_unicode_space(utf8_next(s, kk))) break;
        ns = k;
      }
      start = ns;
    }
    if (at.rstrip) {
      while (stop < s.size()) {
        size_t kk = stop;
        if (!is_unicode_space(utf8_next(s, kk))) break;
        stop = kk;
      }
    }
    if (start_offset < start)
      out.push_back(Piece{s.substr(start_offset, start - start_offset), -1,
                          at_start && start_offset == 0});
    out.push_back(Piece{std::string(), at.id, false});
    start_offset = stop;
    i = std::max(stop, i + len);
  }
  if (start_offset < s.size())
    out.push_back(Piece{s.substr(start_offset), -1, at_start && start_offset == 0});
}

}  // namespace llmrt::tokenizer_detail
