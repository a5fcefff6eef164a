"""A LoRA adapter kept apart from its base (model.adapter_mode=separate): each adapted linear becomes

    LoraLinear(x) = base(x) + lora_B(lora_A(x))      lora_B's weight holding PEFT's scaling (alpha / r, or rsLoRA's)

The base linear stays exactly as the quantize stage left it, so its weights are the same bytes whatever the adapter:
lower moves them (every constant but the branches') into foundation.ptd, which several adapter programs then share.
The branches run in the activation dtype, unquantized: a rank-16 branch costs 2 x 16 x width weights, a few percent
of its base.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from pipeline.model import adapter

# a constant belongs to the adapter (stays in the program) when its placeholder names a branch's weight:
# torch.export names a parameter p_<fqn, dots as underscores, lower case>: model.layers.0.q_proj.lora_A.weight ->
# p_model_layers_0_q_proj_lora_a_weight
BRANCH_WEIGHT = re.compile(r"_lora_[ab]_weight$", re.IGNORECASE)
FOUNDATION_TAG = "foundation"  # every other constant's data file: foundation.ptd


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(a.shape[1], a.shape[0], bias=False, dtype=a.dtype)
        self.lora_B = nn.Linear(b.shape[1], b.shape[0], bias=False, dtype=b.dtype)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its norms' and embeddings' float parameters (quantized linears hold ints)."""
    for p in model.parameters():
        if p.dtype.is_floating_point and type(p) is nn.Parameter:
            return p.dtype
    return torch.float32


def attach(model: nn.Module, branches: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Wrap each named linear of `model` (HF module names) with its branch (A [r, in], B [out, r] scaled); returns how
    many. A name that is not a linear of the model is an error naming it."""
    dtype = activation_dtype(model)
    for name, (a, b) in branches.items():
        try:
            base = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"model.adapter: the adapter adapts {name!r}, which this model does not have") from None
        if isinstance(base, LoraLinear):
            raise ValueError(f"model.adapter: {name!r} already carries an adapter")
        if not isinstance(base, nn.Linear) or (base.in_features, base.out_features) != (a.shape[1], b.shape[0]):
            shape = tuple(getattr(base, "weight", a).shape)
            raise ValueError(f"model.adapter: {name!r} is {type(base).__name__} {shape}, not a linear the adapter's "
                             f"[{b.shape[0]}, {a.shape[1]}] update fits")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, LoraLinear(base, a.to(dtype), b.to(dtype)))
    return len(branches)


def attach_adapter(module, cfg, smoothing: Optional[Path] = None) -> int:
    """The adapter's branches beside the linears of a wrapped module (kept apart); returns how many. `smoothing`: the
    quantize stage's scales (smoothing.pt) when the module is the smoothed one: a base linear whose input is divided
    by s reads it through A * s, one whose output rows are divided by s gets B's rows divided too, so each branch
    adds what it adds to the unsmoothed model."""
    found = adapter.branches(cfg.model.adapter)
    if smoothing is not None and smoothing.exists():
        scales = torch.load(smoothing, weights_only=True)
        for name, (a, b) in found.items():
            if name in scales["input"]:
                a = a * scales["input"][name].float()[None, :]
            if name in scales["rows"]:
                start, stop, d = scales["rows"][name]
                b = b.clone()
                b[start:stop] /= d.float()[:, None]
            found[name] = (a, b)
    return attach(module.model, found)


def in_foundation(node) -> str | None:
    """ExecuTorch's constant tag for a placeholder: the branches' weights stay in the program, every other constant
    goes to foundation.ptd."""
    return None if BRANCH_WEIGHT.search(node.name) else FOUNDATION_TAG


def tag_delegate_constants(gm):
    """The edge transform pass (before partitioning) that marks each constant a delegate serializes for
    foundation.ptd (XNNPACK reads the mark, then stores the bytes by their hash in the named data file)."""
    from executorch.exir.pass_base import PassResult
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta.setdefault("custom", {})["delegate_constant_tag"] = in_foundation(node)
    return PassResult(gm, False)
