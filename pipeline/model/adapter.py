"""A fine-tune given as a PEFT LoRA adapter (model.adapter: its folder, adapter_config.json and the adapter's
weights), in one of two ways (model.adapter_mode):

- merge (the default): merged into the base model's weights at download, before anything reads them: every later
  stage sees one plain checkpoint, so quantization rounds the fine-tuned weights, not the base's. PEFT merges
  (`merge_and_unload`): W + B A * scale in the checkpoint's dtype, and its variants (rsLoRA's scale, DoRA's
  magnitudes, modules_to_save) as PEFT defines them. The adapter's files are part of the download stage's key.
- separate: the base is downloaded, wrapped, calibrated and quantized as if there were no adapter (those entries
  are shared by every adapter of the base); export puts each adapted linear's branch beside it
  (pipeline/model/layers/lora.py) and lower writes the base's weights to foundation.ptd. The adapter's files are
  part of the export stage's key.
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


def separate(cfg) -> bool:
    """Whether this build keeps its adapter apart (model.adapter_mode=separate with an adapter)."""
    from pipeline.registry import v
    return bool(cfg.model.adapter) and v(cfg.model.adapter_mode) == "separate"


def separate_problem(path: str) -> Optional[str]:
    """Why this adapter cannot be kept apart from its base (it may still merge), or None. Reads its config and the
    names of its weights."""
    config = json.loads((folder(path) / CONFIG).read_text())
    merge_only = "merges only (model.adapter_mode=merge)"
    if config.get("use_dora"):
        return f"DoRA rescales each base weight by its norm after the update: it {merge_only}"
    if config.get("modules_to_save"):
        return (f"modules_to_save {config['modules_to_save']} replaces base modules whole, so the foundation would "
                f"differ per adapter: it {merge_only}")
    if config.get("fan_in_fan_out") or config.get("lora_bias"):
        return f"fan_in_fan_out / lora_bias: it {merge_only}"
    other = [k for k in weight_names(path) if not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if other:
        return (f"holds {other[:3]}{' ...' if len(other) > 3 else ''}, not a linear's lora_A / lora_B (an embedding's "
                f"adapter, or another kind): it {merge_only}")
    return None


def weights_file(path: str) -> Path:
    return next(folder(path) / w for w in WEIGHTS if (folder(path) / w).is_file())


def weight_names(path: str) -> list[str]:
    f = weights_file(path)
    if f.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(str(f), "pt") as st:
            return list(st.keys())
    import torch
    return list(torch.load(f, map_location="cpu", weights_only=True))


def module_name(key: str) -> str:
    """The base model's module a PEFT weight name adapts: base_model.model.<module>.lora_A.weight -> <module>."""
    return key.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight").removeprefix("base_model.model.")


def branches(path: str) -> dict:
    """Each adapted linear's (A [r, in], B [out, r] times its scaling), by module name in the base model, scaled as
    PEFT's LoRA layer scales: alpha / r, or alpha / sqrt(r) with rsLoRA; r is the module's own (rank_pattern's), alpha
    alpha_pattern's where it names the module (PEFT's own matching)."""
    import torch
    from peft.utils.other import get_pattern_key
    config = json.loads((folder(path) / CONFIG).read_text())
    f = weights_file(path)
    if f.suffix == ".safetensors":
        from safetensors.torch import load_file
        weights = load_file(str(f))
    else:
        weights = torch.load(f, map_location="cpu", weights_only=True)
    out = {}
    alphas = config.get("alpha_pattern") or {}
    for key, a in weights.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = module_name(key)
        b = weights[key.replace(".lora_A.", ".lora_B.")]
        r = a.shape[0]  # rank_pattern's, where it names this module
        alpha = alphas.get(get_pattern_key(alphas.keys(), name), config["lora_alpha"])
        scaling = alpha / (r ** 0.5 if config.get("use_rslora") else r)
        out[name] = (a.float(), b.float() * scaling)
    return out


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
