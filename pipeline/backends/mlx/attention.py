"""The attention ops the MLX delegate lowers, switched into the cache modes' wrappers before torch.export:
- custom, both flags (the default): mlx::kv_cache_update on BHSD buffers [1, Hkv, slots, D] + mlx::custom_sdpa
            (flat layers), or an explicit window/ring mask and aten SDPA (sliding layers; custom_sdpa has no window);
- custom, custom_sdpa alone: HF's StaticCache writes its BHSD buffers with index_copy_ (MLX IndexCopyNode), then
            mlx::custom_sdpa over them: causal from the start position (flat layers), or over the whole buffer
            with an explicit window mask (sliding layers), as the MLX example's sliding-window attention does;
- custom, custom_kv_cache alone: mlx::kv_cache_update into the wrapper's BHSD buffers (flat, the whole context),
            then aten SDPA with an explicit causal (and window) mask;
- offgraph: kvcache::update_and_attend (the runtime owns the cache; the interpreter provides it);
- static:   HF's SDPA over the in-graph cache, unchanged.
Either flag alone keeps the whole context in every layer, as the mode's wrappers do (rings are the pair's).
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.model.layers.attention import attention_layers, kv_source, step_args


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
        out = _masked_sdpa(query, src.k_cache, src.v_cache, _mask(positions, slots, window, ring, query.dtype),
                           scaling)
    return out.transpose(1, 2).contiguous(), None


def _mask(positions: torch.Tensor, slots: int, window: int, ring: int, dtype) -> torch.Tensor:
    """Additive mask [T, slots] of a step at `positions` over a cache of `slots` entries: key <= query and, with a
    window w > 0, key > query - w; a ring's slots hold the positions _ring_positions says (< 0: empty)."""
    qpos = positions.reshape(-1, 1)
    kpos = _ring_positions(qpos[-1, 0] + 1, slots).unsqueeze(0) if ring else torch.arange(slots).unsqueeze(0)
    visible = (kpos <= qpos) & (kpos > qpos - window) & (kpos >= 0) if window > 0 else kpos <= qpos
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf"))


def _masked_sdpa(query, k, v, mask, scaling):
    """aten SDPA over whole BHSD caches under an explicit mask (GQA by repeating the K/V heads)."""
    group = query.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)


def mlx_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """custom_sdpa alone: key/value are HF's whole static cache [1, Hkv, S, D] (a KV-shared layer: its source's, which
    HF passes on; every row goes through: _keep_all_rows), this step already written by index_copy_; mlx::custom_sdpa
    attends over it."""
    positions, scaling = step_args("mlx custom_sdpa", query, scaling, kwargs)
    T, slots, window = query.shape[2], key.shape[2], module.sdpa_window
    start = _start(positions, T, slots)
    torch._check(start + T <= slots)
    if window == 0:
        out = torch.ops.mlx.custom_sdpa(query, key, value, start, None, 0.0, True, scaling)
    else:  # the op slices keys [0, start + T): from start S - T it keeps the whole buffer, the mask the window
        mask = _mask(positions, slots, window, 0, query.dtype)
        out = torch.ops.mlx.custom_sdpa(query, key, value, slots - T, mask, 0.0, False, scaling)
    return out.transpose(1, 2).contiguous(), None


def mlx_update_cache_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """custom_kv_cache alone: mlx::kv_cache_update writes this step into the layer's flat BHSD buffers
    [1, Hkv, S, D], then aten SDPA over them under the causal (and window) mask. A KV-shared layer writes nothing:
    it reads its source's buffers, written earlier in this forward (every row goes through: _keep_all_rows)."""
    positions, scaling = step_args("mlx custom_kv_cache", query, scaling, kwargs)
    src = kv_source(module)
    T, slots = query.shape[2], src.kv_k_cache.shape[2]
    start = _start(positions, T, slots)
    torch._check(start + T <= slots)
    if src is module:
        torch.ops.mlx.kv_cache_update(module.kv_k_cache, key, start, 0)
        torch.ops.mlx.kv_cache_update(module.kv_v_cache, value, start, 0)
    mask = _mask(positions, slots, src.kv_mask_window, 0, query.dtype)
    out = _masked_sdpa(query, src.kv_k_cache, src.kv_v_cache, mask, scaling)
    return out.transpose(1, 2).contiguous(), None


def mlx_offgraph_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    positions, scaling = step_args("mlx offgraph", query, scaling, kwargs)
    # A KV-shared layer gets its source's K/V of this step (HF's shared_kv_states) and the source's cache id:
    # the delegate has no read-only attend, so it writes the same entries again (one copy in the cache).
    out = torch.ops.kvcache.update_and_attend(query, key, value, positions.reshape(-1, 1),
                                              module._offgraph_cache_id, scaling, query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _custom(module, max_context_len: int, flags: dict) -> str:
    from pipeline.model.cache_modes import custom_split
    from pipeline.model.cache_modes.custom import CustomCacheLM, fused
    want = (CustomCacheLM if fused(flags) else
            custom_split.SdpaStaticCacheLM if flags["custom_sdpa"] else custom_split.UpdateCacheLM)
    if not isinstance(module, want):
        raise TypeError(f"cache.mode=custom with {flags}: expected the mode's {want.__name__}, got "
                        f"{type(module).__name__}")
    if not fused(flags):
        sdpa = flags["custom_sdpa"]
        module.use_attention(*(("mlx_sdpa", mlx_sdpa_attention) if sdpa else
                               ("mlx_update_cache", mlx_update_cache_attention)))
        _keep_all_rows(module)
        return ("HF StaticCache index_copy_ + mlx::custom_sdpa (window layers: masked)" if sdpa else
                "mlx::kv_cache_update + masked sdpa")
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


def _offgraph(module, max_context_len: int, flags: dict) -> str:
    module.use_attention("mlx_offgraph", mlx_offgraph_attention)
    _keep_all_rows(module)
    return "kvcache::update_and_attend"


def _static(module, max_context_len: int, flags: dict) -> str:
    return "HF sdpa over a static cache"


# cache mode -> how its wrapper takes the MLX ops
BY_MODE = {"static": _static, "custom": _custom, "offgraph": _offgraph}


def prepare_attention(module: nn.Module, mode: str, max_context_len: int, flags: dict | None = None) -> dict:
    """Switch a wrapped module's attention to the MLX ops before torch.export (flags: cache.custom_sdpa /
    cache.custom_kv_cache; None: the mode's default); returns a report."""
    from pipeline.model.cache_modes import CACHE_MODES
    return {"attention": BY_MODE[mode](module, max_context_len, flags or CACHE_MODES[mode].FLAGS[0])}
