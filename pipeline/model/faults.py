"""Deliberately broken programs, to show what the verify gate catches (tests/stages/test_gate_faults.py,
bench/gate_calibration.py). A fault changes the module export captures, never the eager references verify
measures the program against:

    python -m pipeline recipe=tiny_llama_xnnpack_8da4w export.fault=heads_swapped     # verify must fail

- layer_permuted: a late layer's down_proj has its output rows permuted;
- group_scale_doubled: a mid layer's up_proj has one group's scales doubled (its first 32 input channels, every
  row);
- heads_swapped: two query heads of a late layer's q_proj are swapped;
- ring_one_short: cache.mode=custom, the sliding layers' rings hold one slot fewer than window + chunk - 1.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.model.attention import attention_layers

FAULTS = ("layer_permuted", "group_scale_doubled", "heads_swapped", "ring_one_short")


def _row_tensors(linear: nn.Linear) -> list[torch.Tensor]:
    """The tensors of a linear's weight whose first dim is the output channel (a quantized weight's ints, scales
    and zero points, or the float weight)."""
    w = linear.weight
    if hasattr(w, "qdata"):
        return [t for t in (w.qdata, w.scale, getattr(w, "zero_point", None)) if isinstance(t, torch.Tensor)]
    return [w.data]


def _reorder_rows(linear: nn.Linear, order: torch.Tensor) -> None:
    for t in _row_tensors(linear):
        t.copy_(t[order].clone())


def _layers(model: nn.Module):
    return model.model.layers


def layer_permuted(module) -> str:
    layer = len(_layers(module.model)) - 2
    down = _layers(module.model)[layer].mlp.down_proj
    n = down.out_features
    _reorder_rows(down, torch.roll(torch.arange(n), 1))
    return f"layers[{layer}].mlp.down_proj: output rows rolled by one"


def group_scale_doubled(module) -> str:
    layer = len(_layers(module.model)) // 2
    up = _layers(module.model)[layer].mlp.up_proj
    w = up.weight
    if hasattr(w, "qdata"):
        w.scale.view(w.scale.shape[0], -1)[:, 0] *= 2
    else:
        w.data[:, :32] *= 2
    return f"layers[{layer}].mlp.up_proj: group 0 (input channels 0-31) doubled in every row"


def heads_swapped(module) -> str:
    layer = len(_layers(module.model)) - 2
    attn = _layers(module.model)[layer].self_attn
    d = attn.head_dim
    order = torch.arange(attn.q_proj.out_features)
    order[:d], order[d:2 * d] = torch.arange(d, 2 * d), torch.arange(d)
    _reorder_rows(attn.q_proj, order)
    return f"layers[{layer}].self_attn.q_proj: query heads 0 and 1 swapped"


def ring_one_short(module) -> str:
    short = 0
    for m in attention_layers(module.model):
        if getattr(m, "kv_window", 0) > 0:
            for name in ("k_cache", "v_cache"):
                buf = getattr(m, name)
                m.register_buffer(name, buf[:-1].clone(), persistent=False)
            short += 1
    if not short:
        raise ValueError("ring_one_short: the module has no ring caches (cache.mode=custom, a sliding-window model)")
    return f"{short} ring layers one slot short"


@torch.no_grad()
def inject(module, fault: str) -> str:
    """Break `module` in place; returns what was done."""
    return {"layer_permuted": layer_permuted, "group_scale_doubled": group_scale_doubled,
            "heads_swapped": heads_swapped, "ring_one_short": ring_one_short}[fault](module)
