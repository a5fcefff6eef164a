// Post-processors: TemplateProcessing, ByteLevel (no-op on ids), Bert/RobertaProcessing, Sequence.
#include <algorithm>
#include <cstdint>

#include <nlohmann/json.hpp>

#include "tokenizer/components.h"
#include "tokenizer/tokenizer.h"

namespace llmrt::tokenizer_detail {

std::unique_ptr<PostProcessor> PostProcessor::from_json(const json& j, int depth) {
  check_nesting(depth, "post_processor");
  auto p = std::make_unique<PostProcessor>();
  std::string t = j.value("type", "");
  if (t == "TemplateProcessing") {
    p->kind = kTemplate;
    const json& specials = j.value("special_tokens", json::object());
    for (auto& item : j.at("single")) {
      if (item.contains("Sequence")) {
        p->items.emplace_back();
        p->is_seq.push_back(true);
      } else if (item.contains("SpecialToken")) {
        std::string name = item["SpecialToken"].at("id").get<std::string>();
        if (!specials.contains(name))
          throw TokenizerError("tokenizer.json: TemplateProcessing refers to unknown special token '" +
                               name + "'");
        std::vector<int32_t> ids;
        for (const json& id : specials[name].at("ids"))
          ids.push_back(static_cast<int32_t>(json_int(id, "TemplateProcessing special token id", 0, INT32_MAX)));
        p->items.push_back(std::move(ids));
        p->is_seq.push_back(false);
      } else {
        throw TokenizerError("tokenizer.json: unsupported TemplateProcessing item");
      }
    }
  } else if (t == "ByteLevel") {
    p->kind = kNoop;
  } else if (t == "BertProcessing" || t == "RobertaProcessing") {
    p->kind = kWrap;
    p->before.push_back(static_cast<int32_t>(json_int(j.at("cls").at(1), "cls id", 0, INT32_MAX)));
    p->after.push_back(static_cast<int32_t>(json_int(j.at("sep").at(1), "sep id", 0, INT32_MAX)));
  } else if (t == "Sequence") {
    p->kind = kSequence;
    for (auto& c : j.at("processors")) p->children.push_back(from_json(c, depth + 1));
  } else {
    throw TokenizerError("tokenizer.json: unsupported post_processor type '" + t + "'");
  }
  return p;
}

void PostProcessor::apply(std::vector<int32_t>& ids) const {
  switch (kind) {
    case kNoop:
      return;
    case kSequence:
      for (auto& c : children) c->apply(ids);
      return;
    case kWrap: {
      std::vector<int32_t> out(before);
      out.insert(out.end(), ids.begin(), ids.end());
      out.insert(out.end(), after.begin(), after.end());
      ids.swap(out);
      return;
    }
    case kTemplate: {
      std::vector<int32_t> out;
      out.reserve(ids.size() + 4);
      for (size_t i = 0; i < items.size(); ++i) {
        if (is_seq[i]) out.insert(out.end(), ids.begin(), ids.end());
        else out.insert(out.end(), items[i].begin(), items[i].end());
      }
      ids.swap(out);
      return;
    }
  }
}

int32_t PostProcessor::largest_id() const {
  int32_t m = -1;
  for (const auto& item : items)
    for (int32_t id : item) m = std::max(m, id);
  for (int32_t id : before) m = std::max(m, id);
  for (int32_t id : after) m = std::max(m, id);
  for (const auto& c : children) m = std::max(m, c->largest_id());
  return m;
}

int32_t PostProcessor::leading_special() const {
  if (kind == kTemplate && !items.empty() && !is_seq[0] && !items[0].empty()) return items[0][0];
  if (kind == kWrap && !before.empty()) return before[0];
  if (kind == kSequence) {
    for (auto& c : children) {
      int32_t b = c->leading_special();
      if (b >= 0) return b;
    }
  }
  return -1;
}

}  // namespace llmrt::tokenizer_detail
