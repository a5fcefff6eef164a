// Normalizers: Replace, Prepend, Sequence.
#include <nlohmann/json.hpp>

#include "tokenizer/components.h"
#include "tokenizer/tokenizer.h"

namespace llmrt::tokenizer_detail {

std::unique_ptr<Normalizer> Normalizer::from_json(const json& j, int depth) {
  check_nesting(depth, "normalizer");
  auto n = std::make_unique<Normalizer>();
  std::string t = j.value("type", "");
  if (t == "Replace") {
    n->kind = kReplace;
    n->pattern = Pattern::from_json(j.at("pattern"), "Replace normalizer");
    n->content = j.at("content").get<std::string>();
  } else if (t == "Prepend") {
    n->kind = kPrepend;
    n->content = j.at("prepend").get<std::string>();
  } else if (t == "Sequence") {
    n->kind = kSequence;
    for (auto& c : j.at("normalizers")) n->children.push_back(from_json(c, depth + 1));
  } else {
    throw TokenizerError("tokenizer.json: unsupported normalizer type '" + t + "'");
  }
  return n;
}

void Normalizer::apply(std::string& s) const {
  switch (kind) {
    case kReplace: {
      std::vector<std::pair<size_t, size_t>> found;
      pattern.find_all(s, found);
      if (found.empty()) return;
      std::string out;
      out.reserve(s.size() + found.size() * content.size());
      size_t prev = 0;
      for (auto& f : found) {
        out.append(s, prev, f.first - prev);
        out += content;
        prev = f.second;
      }
      out.append(s, prev, std::string::npos);
      s.swap(out);
      return;
    }
    case kPrepend:
      if (!s.empty()) s.insert(0, content);
      return;
    case kSequence:
      for (auto& c : children) c->apply(s);
      return;
  }
}

}  // namespace llmrt::tokenizer_detail
