"""Chat templates for tokenizers that carry none (a GGUF without `tokenizer.chat_template`, such as the Gemma 3 package
here): the turn formats the C++ runners know (native/src/runtime/chat_template.cpp), in Jinja. The server picks one
when the vocabulary holds its turn tokens, and says so; --chat-template NAME or FILE chooses."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from pipeline.abi import CHAT_TEMPLATE_MARKERS

TEMPLATES = {
    "chatml": (
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    # Gemma has two roles: a system message opens the first user turn
    "gemma": (
        "{{ bos_token }}{%- set ns = namespace(system='') -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\\n\\n' -%}"
        "{%- else -%}"
        "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' }}"
        "{{ (ns.system if m['role'] != 'assistant' else '') + (m['content'] | trim) + '<end_of_turn>\\n' }}"
        "{%- set ns.system = '' -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"),
    "llama3": (
        "{{ bos_token }}{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor -%}"
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
}


def chat_template(choice: Optional[str], tokenizer) -> tuple[Optional[str], Optional[str], str]:
    """(the template, the runners' name for its turn format or None, a line that says where it came from)."""
    if choice in TEMPLATES:
        return TEMPLATES[choice], choice, f"the built-in {choice} template (--chat-template)"
    if choice:
        return Path(choice).read_text(), None, f"the template in {choice}"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template, None, "the tokenizer's template"
    vocab = tokenizer.get_vocab()
    for name, marker in CHAT_TEMPLATE_MARKERS.items():
        if name in TEMPLATES and marker in vocab:
            return TEMPLATES[name], name, (f"the built-in {name} template: the tokenizer has none, and its "
                                           f"vocabulary holds {marker} (--chat-template chooses another)")
    return None, None, "none: the tokenizer has no chat template (chat requests are refused; --chat-template)"
