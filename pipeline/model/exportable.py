"""The rewrites that make an HF causal LM export, applied after HF's own forward has given wrap's reference (so the
self-check covers them): each computes what HF computes within the build's context.

- experts: a mixture-of-experts layer's stacked expert weights become linears (pipeline/model/experts.py);
- longrope: HF switches a longrope rotary between its short and long factors on every call, by the sequence's
  length, and writes the chosen frequencies into a buffer (a buffer mutation each forward). Preflight keeps the
  context within original_max_position_embeddings, where the switch always picks the short factors: they are pinned.
"""
from __future__ import annotations

from torch import nn

from pipeline.model.experts import rewrite_experts

PINNED_LONGROPE = "longrope, pinned to its short factors"  # no "dynamic", not "longrope": HF's wrapper skips it


def pin_longrope(model: nn.Module) -> int:
    """Pin every longrope rotary embedding to its short factors (its original frequencies); returns how many."""
    count = 0
    for m in model.modules():
        if getattr(m, "rope_type", None) == "longrope" and hasattr(m, "original_inv_freq"):
            m.inv_freq = m.original_inv_freq.clone()
            m.rope_type = PINNED_LONGROPE
            count += 1
    return count


def make_exportable(model: nn.Module) -> dict:
    """Apply every rewrite the model needs in place; returns what was done."""
    return {"experts_rewritten": rewrite_experts(model), "longrope_pinned": pin_longrope(model)}
