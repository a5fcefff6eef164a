"""A downloaded checkpoint made into what every later stage loads: a text causal LM with a fast tokenizer.

- Multimodal checkpoints (config.json nests the text part under `text_config`, e.g. gemma-4-E2B-it's
  Gemma4ForConditionalGeneration) keep only their language model, saved as the text config's causal LM
  (Gemma4ForCausalLM): the vision / audio towers are never exported, and the stages load `AutoModelForCausalLM`.
- Processor-backed checkpoints (AutoProcessor: the tokenizer sits inside a processor, the chat template in
  chat_template.jinja / processor_config.json) get their tokenizer saved as tokenizer.json + tokenizer_config.json
  with the chat template, so `AutoTokenizer` and the C++ runner's tokenizer read it.
"""
from __future__ import annotations

import json
from pathlib import Path

from torch import nn


def is_multimodal(folder: Path) -> bool:
    cfg = json.loads((folder / "config.json").read_text())
    return isinstance(cfg.get("text_config"), dict)


def text_causal_lm(model: nn.Module) -> nn.Module:
    """The causal LM of a multimodal model's text part (same weights, text config)."""
    from transformers import AutoModelForCausalLM
    text_cfg = model.config.get_text_config()
    lm = getattr(model.model, "language_model", None) if hasattr(model, "model") else None
    if lm is None:
        raise ValueError(f"{type(model).__name__}: no language_model to take the text model from")
    causal = AutoModelForCausalLM.from_config(text_cfg, dtype=next(model.parameters()).dtype)
    missing, unexpected = causal.model.load_state_dict(lm.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.endswith("layer_scalar")]:
        raise ValueError(f"{type(model).__name__} -> {type(causal).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    if getattr(model, "lm_head", None) is not None and not text_cfg.tie_word_embeddings:
        causal.lm_head.load_state_dict(model.lm_head.state_dict())
    causal.tie_weights()
    return causal.eval()


def keep_text_model(folder: Path) -> dict:
    """Rewrite a multimodal checkpoint folder as its text causal LM; returns what was done."""
    if not is_multimodal(folder):
        return {}
    from transformers import AutoModelForCausalLM
    full = AutoModelForCausalLM.from_pretrained(folder)
    before = type(full).__name__
    causal = text_causal_lm(full)
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    causal.save_pretrained(folder)
    return {"text_model": {"from": before, "to": type(causal).__name__}}


def _with_vocab(tok):
    """tok, or None if it knows only its special tokens."""
    # transformers 5 builds such a tokenizer from config.json's model_type (Gemma, Qwen2) when no tokenizer file exists
    return tok if tok is not None and len(tok) > len(set(tok.all_special_ids)) else None


def ensure_tokenizer(folder: Path, trust_remote_code: bool = False) -> dict:
    """tokenizer.json (and its chat template) in the folder, from AutoTokenizer or else the AutoProcessor's."""
    if (folder / "tokenizer.json").exists() and not (folder / "processor_config.json").exists():
        return {}
    from transformers import AutoProcessor, AutoTokenizer
    how = "tokenizer"
    try:
        tok = _with_vocab(AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code))
    except (OSError, ValueError, KeyError, TypeError):
        tok = None
    if tok is None or getattr(tok, "chat_template", None) is None:
        try:
            proc = AutoProcessor.from_pretrained(folder, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError, TypeError):
            proc = None
        inner = _with_vocab(getattr(proc, "tokenizer", None))
        if inner is not None:
            if getattr(inner, "chat_template", None) is None and getattr(proc, "chat_template", None):
                inner.chat_template = proc.chat_template
            tok, how = inner, "processor"
    if tok is None:
        raise RuntimeError(f"{folder}: neither AutoTokenizer nor AutoProcessor loads a tokenizer")
    tok.save_pretrained(folder)
    if not (folder / "tokenizer.json").exists():
        raise RuntimeError(f"{folder}: the tokenizer has no fast (tokenizer.json) form")
    return {"tokenizer_from": how}
