// Pre-tokenizers: ByteLevel, Split, Digits, Whitespace, WhitespaceSplit, Metaspace, Sequence.
#include <nlohmann/json.hpp>

#include "tokenizer/components.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace llmrt::tokenizer_detail {

ByteMap::ByteMap() {
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    uint32_t cp = keep ? b : 256 + n++;
    utf8_append(enc[b], cp);
    dec[cp] = static_cast<uint8_t>(b);
  }
}

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

namespace {

const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

std::unique_ptr<PreTokenizer> PreTokenizer::from_json(const json& j, int depth) {
  check_nesting(depth, "pre_tokenizer");
  auto p = std::make_unique<PreTokenizer>();
  std::string t = j.value("type", "");
  if (t == "ByteLevel") {
    p->kind = kByteLevel;
    p->add_prefix_space = j.value("add_prefix_space", false);
    p->use_regex = j.value("use_regex", true);
    if (p->use_regex) p->pattern.regex = std::make_unique<Regex>(kGpt2Pattern);
  } else if (t == "Split") {
    p->kind = kSplit;
    p->pattern = Pattern::from_json(j.at("pattern"), "Split pre-tokenizer");
    p->behavior = parse_behavior(j.at("behavior").get<std::string>());
    p->invert = j.value("invert", false);
  } else if (t == "Digits") {
    p->kind = kSplit;
    bool individual = j.value("individual_digits", false);
    p->pattern.regex = std::make_unique<Regex>(individual ? R"(\p{N})" : R"(\p{N}+)");
    p->behavior = Behavior::Isolated;
  } else if (t == "Whitespace") {
    p->kind = kSplit;
    p->pattern.regex = std::make_unique<Regex>(R"(\w+|[^\w\s]+)");
    p->behavior = Behavior::Removed;
    p->invert = true;
  } else if (t == "WhitespaceSplit") {
    p->kind = kSplit;
    p->pattern.regex = std::make_unique<Regex>(R"(\s+)");
    p->behavior = Behavior::Removed;
  } else if (t == "Metaspace") {
    p->kind = kMetaspace;
    p->replacement = j.value("replacement", std::string("\xE2\x96\x81"));
    p->prepend_scheme = j.value("prepend_scheme", std::string());
    if (p->prepend_scheme.empty())
      p->prepend_scheme = j.value("add_prefix_space", true) ? "always" : "never";
    p->split = j.value("split", true);
    // an empty replacement would be an empty split pattern: it matches everywhere without advancing
    if (p->replacement.empty()) throw TokenizerError("tokenizer.json: Metaspace pre_tokenizer with an empty replacement");
    p->pattern.literal = p->replacement;
  } else if (t == "Sequence") {
    p->kind = kSequence;
    for (auto& c : j.at("pretokenizers")) p->children.push_back(from_json(c, depth + 1));
  } else {
    throw TokenizerError("tokenizer.json: unsupported pre_tokenizer type '" + t + "'");
  }
  return p;
}

void PreTokenizer::apply(std::vector<Word>& words) const {
  if (kind == kSequence) {
    for (auto& c : children) c->apply(words);
    return;
  }
  std::vector<Word> out;
  out.reserve(words.size() * 2);
  std::vector<std::pair<size_t, size_t>> ranges;
  const ByteMap& bm = byte_map();
  for (auto& w : words) {
    switch (kind) {
      case kByteLevel: {
        std::string s = w.s;
        if (add_prefix_space && (s.empty() || s[0] != ' ')) s.insert(0, " ");
        if (use_regex) {
          split_pieces(s, pattern, Behavior::Isolated, false, ranges);
        } else {
          ranges.assign(1, {0, s.size()});
        }
        bool first = true;
        for (auto& r : ranges) {
          if (r.second == r.first) continue;
          Word nw{std::string(), w.at_start && first};
          first = false;
          for (size_t k = r.first; k < r.second; ++k) nw.s += bm.enc[static_cast<uint8_t>(s[k])];
          out.push_back(std::move(nw));
        }
        break;
      }
      case kSplit: {
        split_pieces(w.s, pattern, behavior, invert, ranges);
        bool first = true;
        for (auto& r : ranges) {
          if (r.second == r.first) continue;
          out.push_back(Word{w.s.substr(r.first, r.second - r.first), w.at_start && first});
          first = false;
        }
        break;
      }
      case kMetaspace: {
        std::string s;
        s.reserve(w.s.size() + 8);
        for (char ch : w.s) {
          if (ch == ' ') s += replacement;
          else s.push_back(ch);
        }
        bool starts = s.compare(0, replacement.size(), replacement) == 0;
        if (!starts && (prepend_scheme == "always" || (prepend_scheme == "first" && w.at_start)))
          s.insert(0, replacement);
        if (split) {
          split_pieces(s, pattern, Behavior::MergedWithNext, false, ranges);
        } else {
          ranges.assign(1, {0, s.size()});
        }
        bool first = true;
        for (auto& r : ranges) {
          if (r.second == r.first) continue;
          out.push_back(Word{s.substr(r.first, r.second - r.first), w.at_start && first});
          first = false;
        }
        break;
      }
      case kSequence:
        break;
    }
  }
  words.swap(out);
}

}  // namespace llmrt::tokenizer_detail
