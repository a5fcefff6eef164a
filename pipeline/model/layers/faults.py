"""Deliberately broken programs, to show what the verify gate catches (tests/stages/test_gate_faults.py,
bench/gate_calibration.py). A fault changes the module export captures, never the eager references verify
measures the program against:

    python -m pipeline recipe=tiny_llama_xnnpack_8da4w export.fault=heads_swapped     # verify must fail

- layer_permuted: a late layer's MLP down projection has its output rows permuted (every expert's, in an MoE layer);
- group_scale_doubled: a mid layer's MLP up projection has one group's scales doubled (its first 32 input channels,
  every row);
- heads_swapped: two query heads of a late layer's q projection are swapped;
- ring_one_short: cache.mode=custom, the sliding layers' rings hold one slot fewer than window + chunk - 1.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.model import archs
from pipeline.model.layers.attention import attention_layers

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


def _mlp_linears(model: nn.Module, layer: int, role: str) -> list[tuple[nn.Linear, int, int]]:
    """(linear, first row, row count) of layer `layer`'s MLP linear of `role` (down or up), as its architecture's
    entry names it: the dense MLP's (up: the up half of a fused gate_up) or every expert's."""
    a = archs.of_model(model)
    decoder = a.decoder_layers(model)[layer]
    mlp = a.mlp_module(decoder)
    if a.has_experts(decoder):
        return [(getattr(x, archs.EXPERT_LINEARS[role]), 0, getattr(x, archs.EXPERT_LINEARS[role]).out_features)
                for x in getattr(mlp, a.experts.bank)]
    if role == "up" and a.mlp.gate_up:
        fused = getattr(mlp, a.mlp.gate_up)
        return [(fused, fused.out_features // 2, fused.out_features // 2)]
    linear = getattr(mlp, a.mlp.down if role == "down" else a.mlp.up)
    return [(linear, 0, linear.out_features)]


def _n_layers(model: nn.Module) -> int:
    return len(archs.of_model(model).decoder_layers(model))


def layer_permuted(module) -> str:
    layer = _n_layers(module.model) - 2
    for down, _, n in _mlp_linears(module.model, layer, "down"):
        _reorder_rows(down, torch.roll(torch.arange(n), 1))
    return f"layers[{layer}]: the MLP's down projection, output rows rolled by one"


def group_scale_doubled(module) -> str:
    layer = _n_layers(module.model) // 2
    for up, first, n in _mlp_linears(module.model, layer, "up"):
        w = up.weight
        if hasattr(w, "qdata"):
            w.scale.view(w.scale.shape[0], -1)[first:first + n, 0] *= 2
        else:
            w.data[first:first + n, :32] *= 2
    return f"layers[{layer}]: the MLP's up projection, group 0 (input channels 0-31) doubled in every row"


def heads_swapped(module) -> str:
    a = archs.of_model(module.model)
    attending = a.attention_layers(module.model)  # the second-to-last attention layer (the last if it is alone)
    layer, decoder = attending[-2] if len(attending) > 1 else attending[-1]
    attn = a.attention_module(decoder)
    q = getattr(attn, a.attention.qkv or a.attention.q)  # a fused qkv holds q's rows first
    d = attn.head_dim
    order = torch.arange(q.out_features)
    order[:d], order[d:2 * d] = torch.arange(d, 2 * d), torch.arange(d)
    _reorder_rows(q, order)
    return f"layers[{layer}]: the attention's q projection, query heads 0 and 1 swapped"


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
