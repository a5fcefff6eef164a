#include "tokenizer/pattern.h"

#include <algorithm>
#include <cstdint>

#include <nlohmann/json.hpp>

#include "tokenizer/components.h"
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

void check_nesting(int depth, const char* what) {
  if (depth > kMaxNesting)
    throw TokenizerError(std::string("tokenizer.json: ") + what + " Sequences nest deeper than " +
                         std::to_string(kMaxNesting) + " levels");
}

int64_t json_int(const json& v, const char* what, int64_t lo, int64_t hi) {
  // is_number_integer covers both signed and unsigned; an unsigned above INT64_MAX is out of range anyway
  bool ok = v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX));
  int64_t x = ok ? v.get<int64_t>() : 0;
  if (!ok || x < lo || x > hi)
    throw TokenizerError(std::string("tokenizer.json: ") + what + " must be an integer in [" + std::to_string(lo) +
                         ", " + std::to_string(hi) + "], got " + v.dump().substr(0, 40));
  return x;
}

int64_t json_int(const json& obj, const char* key, int64_t fallback, const char* what, int64_t lo, int64_t hi) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? fallback : json_int(*it, what, lo, hi);
}

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
