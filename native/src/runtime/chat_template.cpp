#include "runtime/chat_template.h"

#include <stdexcept>

#include "tokenizer/tokenizer.h"

namespace llmrt {

std::vector<std::string> chat_template_names() { return {"llama3", "gemma", "gemma4", "chatml", "0"}; }

ChatTemplate chat_template(const std::string& name) {
  ChatTemplate t;
  t.name = name;
  if (name == "0" || name == "none" || name == "raw") {
    t.name = "0";
    t.raw = true;
  } else if (name == "llama3") {
    t.first_prefix = "<|begin_of_text|>";
    t.user_prefix = "<|start_header_id|>user<|end_header_id|>\n\n";
    t.user_suffix = "<|eot_id|>";
    t.assistant_prefix = "<|start_header_id|>assistant<|end_header_id|>\n\n";
    t.turn_end = "<|eot_id|>";
  } else if (name == "gemma") {
    t.first_prefix = "<bos>";
    t.user_prefix = "<start_of_turn>user\n";
    t.user_suffix = "<end_of_turn>\n";
    t.assistant_prefix = "<start_of_turn>model\n";
    t.turn_end = "<end_of_turn>";
    t.turn_sep = "\n";
  } else if (name == "gemma4") {
    t.first_prefix = "<bos>";
    t.user_prefix = "<|turn>user\n";
    t.user_suffix = "<turn|>\n";
    t.assistant_prefix = "<|turn>model\n";
    t.turn_end = "<turn|>";
    t.turn_sep = "\n";
  } else if (name == "chatml") {
    // SmolLM2's template: a default system turn when the first message is not one.
    t.first_prefix =
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n";
    t.user_prefix = "<|im_start|>user\n";
    t.user_suffix = "<|im_end|>\n";
    t.assistant_prefix = "<|im_start|>assistant\n";
    t.turn_end = "<|im_end|>";
    t.turn_sep = "\n";
  } else {
    std::string known;
    for (auto& n : chat_template_names()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown chat template '" + name + "' (known: " + known + ")");
  }
  return t;
}

std::string ChatTemplate::render(const std::string& user_text, bool first) const {
  if (raw) return user_text;
  std::string s = first ? first_prefix : turn_end + turn_sep;
  s += user_prefix;
  s += user_text;
  s += user_suffix;
  s += assistant_prefix;
  return s;
}

std::vector<int64_t> encode_turn(const Tokenizer& tok, const ChatTemplate& tpl, const std::string& text, bool first) {
  std::vector<int32_t> ids = tok.encode(tpl.render(text, first), /*add_special_tokens=*/false);
  if (tpl.raw && first) {
    const int64_t bos = tok.bos_id();  // the post-processor's, or -1
    if (bos >= 0 && (ids.empty() || ids[0] != bos)) ids.insert(ids.begin(), static_cast<int32_t>(bos));
  }
  return std::vector<int64_t>(ids.begin(), ids.end());
}

}  // namespace llmrt
