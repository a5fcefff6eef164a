"""A fine-tune given as a PEFT LoRA adapter (model.adapter: its folder, adapter_config.json and the adapter's
weights), merged into the base model's weights at download, before anything reads them: every later stage sees
one plain checkpoint, so quantization rounds the fine-tuned weights, not the base's.

PEFT merges (`merge_and_unload`): W + B A * scale in the checkpoint's dtype, and its variants (rsLoRA's scale, DoRA's
magnitudes, modules_to_save) as PEFT defines them. The adapter's files are part of the download stage's key, by hash:
an edited adapter rebuilds.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Optional

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_TYPES = ("LORA",)  # what merge_and_unload folds into plain weights


def folder(path: str) -> Path:
    return Path(path).expanduser()


def files(path: str) -> list[Path]:
    """The adapter's files: its config and weights."""
    return [f for f in sorted(folder(path).iterdir()) if f.name == CONFIG or f.name in WEIGHTS]


def problem(path: str, linear_names: list[str]) -> Optional[str]:
    """Why this adapter cannot be merged into a model of these linears (the geometry's names), or None. Reads
    adapter_config.json only."""
    root = folder(path)
    if not root.is_dir():
        return "not a folder"
    if not (root / CONFIG).is_file():
        return f"has no {CONFIG} (a PEFT adapter folder, as save_pretrained writes it)"
    if not any((root / w).is_file() for w in WEIGHTS):
        return f"has no adapter weights ({' or '.join(WEIGHTS)})"
    try:
        config = json.loads((root / CONFIG).read_text())
    except (OSError, ValueError) as err:
        return f"{CONFIG} unreadable: {err}"
    kind = config.get("peft_type")
    if kind not in PEFT_TYPES:
        return f"peft_type {kind!r} is not merged by this pipeline: allowed {list(PEFT_TYPES)}"
    targets = config.get("target_modules")
    if isinstance(targets, list):  # names (a suffix of module names); a string is PEFT's regex over full names
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in linear_names)
                   and t not in ("embed_tokens", "lm_head")]
        if missing:
            have = sorted({n.rsplit(".", 1)[-1] for n in linear_names})
            return f"target_modules {missing} name no linear of this model (its linears: {have})"
    elif isinstance(targets, str) and not any(re.fullmatch(targets, n) for n in linear_names):
        return f"target_modules {targets!r} matches no linear of this model"
    if importlib.util.find_spec("peft") is None:
        return "merging needs PEFT: pip install -e '.[adapters]'"
    return None


def merge(model_dir: Path, path: str) -> dict:
    """Merge the adapter into the checkpoint at model_dir (in place: its weights rewritten, the rest kept); what was
    merged, for the manifest."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    dtype = next(base.parameters()).dtype
    with torch.no_grad():
        merged = PeftModel.from_pretrained(base, folder(path)).merge_and_unload()
    for f in model_dir.glob("*.safetensors"):  # the merged weights replace the shards (their count may change)
        f.unlink()
    for f in model_dir.glob("*.safetensors.index.json"):
        f.unlink()
    merged.to(dtype).save_pretrained(model_dir)
    config = json.loads((folder(path) / CONFIG).read_text())
    return {"adapter": str(folder(path).resolve()), "adapter_rank": config.get("r"),
            "adapter_alpha": config.get("lora_alpha"), "adapter_targets": config.get("target_modules")}
