// Added tokens (tokenizer.json "added_tokens"): matched in the text before the model sees it,
// leftmost-longest, with HF's lstrip / rstrip / single_word rules.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace llmrt::tokenizer_detail {

struct AddedToken {
  std::string content;
  std::string decoded;  // what id_to_token/decode give: the normalized content if normalized
  int32_t id;
  bool special, normalized, lstrip, rstrip, single_word;
};

// Byte trie over added-token contents, for leftmost-longest matching.
class AddedTrie {
 public:
  void add(const std::string& s, int token_index) {
    if (s.empty()) return;
    int node = 0;
    for (unsigned char c : s) {
      uint64_t key = (static_cast<uint64_t>(node) << 8) | c;
      auto it = edges_.find(key);
      if (it == edges_.end()) {
        terminal_.push_back(-1);
        int nn = static_cast<int>(terminal_.size()) - 1;
        edges_.emplace(key, nn);
        node = nn;
      } else {
        node = it->second;
      }
    }
    if (terminal_[node] < 0) terminal_[node] = token_index;
    first_[static_cast<unsigned char>(s[0])] = true;
    any_ = true;
  }
  bool empty() const { return !any_; }
  // Longest token starting at s[i]: returns (token index, length) or (-1, 0).
  std::pair<int, size_t> longest_at(std::string_view s, size_t i) const {
    if (!first_[static_cast<unsigned char>(s[i])]) return {-1, 0};
    int node = 0, best = -1;
    size_t best_len = 0;
    for (size_t k = i; k < s.size(); ++k) {
      auto it = edges_.find((static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(s[k]));
      if (it == edges_.end()) break;
      node = it->second;
      if (terminal_[node] >= 0) {
        best = terminal_[node];
        best_len = k + 1 - i;
      }
    }
    return {best, best_len};
  }

 private:
  std::unordered_map<uint64_t, int> edges_;
  std::vector<int> terminal_{-1};
  bool first_[256] = {};
  bool any_ = false;
};

// A piece of the input: text for the normalizer / model, or one added token.
struct Piece {
  std::string text;
  int32_t id;  // >= 0: an added token
  bool at_start;
};

// Appends to `out` the pieces of s: the matches of `trie` (indices into `added`) and the text
// between them. at_start: s begins the whole input.
void split_added(const std::string& s, const AddedTrie& trie, const std::vector<AddedToken>& added,
                 bool at_start, std::vector<Piece>& out);

}  // namespace llmrt::tokenizer_detail
