// Chat templates (text level; the tokenizer then matches the special tokens).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace llmrt {

struct ChatTemplate {
  std::string name;
  bool raw = false;              // "0": no template
  std::string first_prefix;      // once, before the first user turn (BOS, default system turn)
  std::string user_prefix;       // before the user's text
  std::string user_suffix;       // after the user's text
  std::string assistant_prefix;  // opens the model's turn (generation prompt)
  std::string turn_end;          // token that ends a model turn (added to the stop set)
  std::string turn_sep;          // text after turn_end when closing a model turn

  // The text for a user turn. first: no earlier turn in the context.
  // Otherwise the previous model turn is closed first (turn_end + turn_sep).
  std::string render(const std::string& user_text, bool first) const;
};

class Tokenizer;

// The ids of one user turn (the template applied; raw text as the tokenizer encodes it, with the BOS its
// post-processor adds, if any: what HF's tokenizer, the Python runner and ExecuTorch's runner feed).
std::vector<int64_t> encode_turn(const Tokenizer& tok, const ChatTemplate& tpl, const std::string& text, bool first);

// Throws std::invalid_argument for an unknown name.
ChatTemplate chat_template(const std::string& name);
std::vector<std::string> chat_template_names();

}  // namespace llmrt
