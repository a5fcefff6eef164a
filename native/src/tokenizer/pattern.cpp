#include "tokenizer/pattern.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"

namespace llmrt::tokenizer_detail {

using json = nlohmann::json;

namespace {

// Applies HF's SplitDelimiterBehavior to (range, is_match) pieces of s.
void apply_behavior(std::vector<std::pair<std::pair<size_t, size_t>, bool>>& m, Behavior b,
                    std::vector<std::pair<size_t, size_t>>& out) {
  out.clear();
  switch (b) {
    case Behavior::Isolated:
      for (auto& x : m) out.push_back(x.first);
      break;
    case Behavior::Removed:
      for (auto& x : m)
        if (!x.second) out.push_back(x.first);
      break;
    case Behavior::MergedWithPrevious: {
      bool prev = false;
      for (auto& x : m) {
        if (x.second && !prev && !out.empty()) out.back().second = x.first.second;
        else out.push_back(x.first);
        prev = x.second;
      }
      break;
    }
    case Behavior::MergedWithNext: {
      bool prev = false;
      for (size_t k = m.size(); k-- > 0;) {
        auto& x = m[k];
        if (x.second && !prev && !out.empty()) out.back().first = x.first.first;
        else out.push_back(x.first);
        prev = x.second;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
    case Behavior::Contiguous: {
      bool prev = false;
      for (auto& x : m) {
        if (x.second == prev && !out.empty()) out.back().second = x.first.second;
        else out.push_back(x.first);
        prev = x.second;
      }
      break;
    }
  }
}

}  // namespace

Behavior parse_behavior(const std::string& s) {
  if (s == "Removed") return Behavior::Removed;
  if (s == "Isolated") return Behavior::Isolated;
  if (s == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (s == "MergedWithNext") return Behavior::MergedWithNext;
  if (s == "Contiguous") return Behavior::Contiguous;
  throw TokenizerError("tokenizer.json: unknown split behavior '" + s + "'");
}

Pattern Pattern::from_json(const json& p, const char* where) {
  Pattern out;
  if (p.is_object() && p.contains("String")) {
    out.literal = p["String"].get<std::string>();
    if (out.literal.empty())
      throw TokenizerError(std::string("tokenizer.json: empty pattern in ") + where);
  } else if (p.is_object() && p.contains("Regex")) {
    out.regex = std::make_unique<Regex>(p["Regex"].get<std::string>());
  } else {
    throw TokenizerError(std::string("tokenizer.json: unsupported pattern in ") + where);
  }
  return out;
}

void Pattern::find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
  if (regex) {
    regex->find_all(s, out);
    return;
  }
  out.clear();
  size_t pos = 0;
  while ((pos = s.find(literal, pos)) != std::string_view::npos) {
    out.emplace_back(pos, pos + literal.size());
    pos += literal.size();
  }
}

void split_pieces(std::string_view s, const Pattern& pat, Behavior b, bool invert,
                  std::vector<std::pair<size_t, size_t>>& out) {
  std::vector<std::pair<size_t, size_t>> found;
  pat.find_all(s, found);
  std::vector<std::pair<std::pair<size_t, size_t>, bool>> m;
  m.reserve(found.size() * 2 + 1);
  size_t prev = 0;
  for (auto& f : found) {
    if (prev != f.first) m.push_back({{prev, f.first}, invert});
    m.push_back({f, !invert});
    prev = f.second;
  }
  if (prev != s.size()) m.push_back({{prev, s.size()}, invert});
  apply_behavior(m, b, out);
}

}  // namespace llmrt::tokenizer_detail
