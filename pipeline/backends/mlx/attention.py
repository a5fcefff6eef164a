"""The attention ops the MLX delegate lowers, switched into the cache modes' wrappers before torch.export:
- custom:   mlx::kv_cache_update on BHSD buffers [1, Hkv, slots, D] + mlx::custom_sdpa (flat layers), or
            an explicit window/ring mask and aten SDPA (sliding layers; custom_sdpa has no window);
- offgraph: kvcache::update_and_attend (the runtime owns the cache; the interpreter provides it);
- static:   HF's SDPA over the in-graph cache, unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.model.attention import attention_layers, step_args
from pipeline.model.cache_modes.custom import kv_source


# --- attention functions (HF attention interface: q/k arrive RoPE-rotated, [B,H,T,D]) -------------

def _start(positions: torch.Tensor, T: int, slots: int):
    start = positions.reshape(-1)[0].item()
    torch._check(start >= 0)
    torch._check(T <= slots)
    return start


def _ring_positions(end, slots: int) -> torch.Tensor:
    """Logical position held by each ring slot j after writing up to `end` (exclusive); < 0 = empty."""
    j = torch.arange(slots)
    return j + torch.div(end - 1 - j, slots, rounding_mode="floor") * slots


def mlx_custom_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    positions, scaling = step_args("mlx custom", query, scaling, kwargs)
    src = kv_source(module)  # a KV-shared layer reads its source's buffers, written earlier in this forward
    T, slots, window = query.shape[2], src.k_cache.shape[2], src.kv_window
    start = _start(positions, T, slots)
    ring = slots if (window > 0 and slots < src.kv_context) else 0
    if src is module:
        torch.ops.mlx.kv_cache_update(module.k_cache, key, start, ring)
        torch.ops.mlx.kv_cache_update(module.v_cache, value, start, ring)
    if window == 0:
        torch._check(start + T <= slots)
        out = torch.ops.mlx.custom_sdpa(query, src.k_cache, src.v_cache, start, None, 0.0, True, scaling)
    else:
        qpos = positions.reshape(-1, 1)
        kpos = _ring_positions(qpos[-1, 0] + 1, slots).unsqueeze(0) if ring else torch.arange(slots).unsqueeze(0)
        visible = (kpos <= qpos) & (kpos > qpos - window) & (kpos >= 0)
        mask = torch.zeros(visible.shape, dtype=query.dtype).masked_fill(~visible, float("-inf"))
        group = query.shape[1] // src.k_cache.shape[1]
        k, v = src.k_cache, src.v_cache
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def mlx_offgraph_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    positions, scaling = step_args("mlx offgraph", query, scaling, kwargs)
    # A KV-shared layer gets its source's K/V of this step (HF's shared_kv_states) and the source's cache id:
    # the delegate has no read-only attend, so it writes the same entries again (one copy in the cache).
    out = torch.ops.kvcache.update_and_attend(query, key, value, positions.reshape(-1, 1),
                                              module._offgraph_cache_id, scaling, query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _custom(module, max_context_len: int) -> str:
    for m in attention_layers(module.model):
        if kv_source(m) is not m:
            continue  # a KV-shared layer has no buffers of its own
        # slot-major [slots, Hkv, D] -> BHSD [1, Hkv, slots, D], the layout mlx::kv_cache_update writes
        for name in ("k_cache", "v_cache"):
            buf = getattr(m, name)
            m.register_buffer(name, buf.permute(1, 0, 2).unsqueeze(0).contiguous(), persistent=False)
        m.kv_context = int(max_context_len)
    module.use_attention("mlx_custom", mlx_custom_attention)
    _keep_all_rows(module)
    return "mlx::kv_cache_update + mlx::custom_sdpa (window layers: masked sdpa)"


def _all_rows(*inputs, **kwargs):
    hidden_states, per_layer_inputs, position_embeddings, causal_mask_mapping = inputs[:4]
    return hidden_states, per_layer_inputs, position_embeddings, causal_mask_mapping


def _keep_all_rows(module) -> None:
    """Gemma 4 runs its KV-shared layers on the last row only when one row of logits is kept; the MLX ops take
    as many query rows as K/V rows (update_and_attend) or a start position (custom_sdpa), so every row goes
    through. Set on the model instance after the wrapper was unpickled, before torch.export (never pickled)."""
    for m in module.model.modules():
        if hasattr(type(m), "_maybe_slice_kv_shared_inputs"):
            m._maybe_slice_kv_shared_inputs = _all_rows


def _offgraph(module, max_context_len: int) -> str:
    module.use_attention("mlx_offgraph", mlx_offgraph_attention)
    _keep_all_rows(module)
    return "kvcache::update_and_attend"


def _static(module, max_context_len: int) -> str:
    return "HF sdpa over a static cache"


# cache mode -> how its wrapper takes the MLX ops
BY_MODE = {"static": _static, "custom": _custom, "offgraph": _offgraph}


def prepare_attention(module: nn.Module, mode: str, max_context_len: int) -> dict:
    """Switch a wrapped module's attention to the MLX ops before torch.export; returns a report."""
    return {"attention": BY_MODE[mode](module, max_context_len)}
