"""The rewrites that make an HF causal LM export, applied after HF's own forward has given wrap's reference (so the
self-check covers them): each computes what HF computes within the build's context.

- experts: a mixture-of-experts layer's stacked expert weights become linears (pipeline/model/layers/experts.py);
- fused delta projections: Qwen3-Next's Gated DeltaNet reads q|k|v|z and b|a through two linears grouped per key
  head; its layer becomes HF's Qwen3.5 layer (the same computation) with the four projections the rest of the
  pipeline knows, the rows regrouped;
- longrope: HF switches a longrope rotary between its short and long factors on every call, by the sequence's
  length, and writes the chosen frequencies into a buffer (a buffer mutation each forward). Preflight keeps the
  context within original_max_position_embeddings, where the switch always picks the short factors: they are pinned.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.model import archs
from pipeline.model.layers.experts import rewrite_experts

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


def split_fused_delta(qkvz: torch.Tensor, ba: torch.Tensor, hk: int, hv: int, dk: int, dv: int) -> tuple:
    """in_proj_qkvz's rows, per key head [q Dk | k Dk | v r*Dv | z r*Dv] (r = Hv / Hk), and in_proj_ba's, per key
    head [b r | a r] -> the rows of in_proj_qkv (every head's q, then k, then v: the conv's channel order, which
    Qwen3-Next shares), in_proj_z, in_proj_b, in_proj_a."""
    r, h = hv // hk, qkvz.shape[-1]
    q, k, v, z = qkvz.reshape(hk, 2 * dk + 2 * r * dv, h).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(hk, 2 * r, h).split([r, r], dim=1)
    rows = lambda t: t.reshape(-1, h)  # noqa: E731
    return torch.cat([rows(q), rows(k), rows(v)]), rows(z), rows(b), rows(a)


def split_delta_projections(model: nn.Module) -> int:
    """Replace every Gated DeltaNet with fused projections by HF's Qwen3.5 layer over the same weights (in place);
    returns how many. HF's forward still runs on it (smoothing's calibration does)."""
    a = archs.of_model(model)
    d = a.gated_delta
    if d is None or not d.fused_qkvz:
        return 0
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    config = model.config.get_text_config()
    heads = [getattr(config, key) for key in (d.key_heads_key, d.value_heads_key, d.key_dim_key, d.value_dim_key)]
    count = 0
    for i, layer in enumerate(a.decoder_layers(model)):
        old = getattr(layer, d.path, None)
        if old is None or not hasattr(old, d.fused_qkvz):
            continue
        parts = split_fused_delta(getattr(old, d.fused_qkvz).weight.detach(), getattr(old, d.fused_ba).weight.detach(),
                                  *heads)
        with torch.device("meta"):  # every parameter is replaced below: nothing allocated twice
            new = Qwen3_5GatedDeltaNet(config, i)
        for name, w in zip((d.qkv, d.z, d.b, d.a), parts):
            getattr(new, name).weight = nn.Parameter(w.contiguous(), requires_grad=False)
        for name in (d.conv, d.norm, d.out):
            setattr(new, name, getattr(old, name))
        new.A_log, new.dt_bias = old.A_log, old.dt_bias
        setattr(layer, d.path, new.train(old.training))
        count += 1
    return count


def make_exportable(model: nn.Module) -> dict:
    """Apply every rewrite the model needs in place; returns what was done."""
    return {"experts_rewritten": rewrite_experts(model), "delta_projections_split": split_delta_projections(model),
            "longrope_pinned": pin_longrope(model)}
