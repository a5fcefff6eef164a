"""The `custom` KV-cache mode: the cache lives in the program (mutable buffers, one pair per layer) and
each attention layer calls one fused op that updates it in place and attends.

    llmpipe::cached_attention(q, k, v, k_cache!, v_cache!, position, window, scale, sinks=None) -> out

- q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv] (q and k RoPE-rotated); k_cache [slots,Hkv,D],
  v_cache [slots,Hkv,Dv] (slot-major, like the off-graph storage; an int8 or int4 cache's rows hold their group
  scales before the values: pipeline/model/kv/quant.py); position [T] consecutive.
- window 0: a flat cache, slot = position, keys [0, pos+T). window w > 0: a ring of
  slots = min(w + chunk - 1, max context), slot = position % slots, keys [max(0, pos-w+1), pos+T):
  sliding layers cost window + chunk - 1 positions, not the whole context. A step that wraps the
  ring must satisfy T + w - 1 <= slots (a ring as long as the context never wraps).
- Out: [1,Hq,T,Dv] in q's dtype; attention in fp32. No expanded K/V copies (GQA is an index).
- sinks: None, or fp32 [Hq] (gpt-oss): a logit per head that every row's softmax also counts, with a zero value.
- A KV-shared layer (Gemma 4) has no buffers: `llmpipe::cached_attend(q, k_cache, v_cache, position, window,
  scale)` attends over its source layer's, read-only, for its Tq query rows (possibly the step's last ones).
- To torch.export the op mutates its cache arguments (the schema says so); ExecuTorch keeps the
  buffers in the program and calls `llmpipe::cached_attention.out` in place
  (native/src/kernels/custom_kernel.cpp, the attention core shared with the off-graph op).
- That is both flags (cache.custom_sdpa, cache.custom_kv_cache: the default). Either alone takes half of it, as
  ExecuTorch's llama::custom_sdpa / llama::update_cache can be used apart (pipeline/model/cache_modes/custom_split.py):
  llmpipe::sdpa over HF's own static cache, or llmpipe::update_cache followed by the standard attention math.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pipeline.model.layers.attention import (HookedAttentionLM, attend_gathered, attention_layers, check_step,
                                             define_op, kv_source, link_kv_sources, query_positions, sinks_arg,
                                             step_args)
from pipeline.model.layers import recurrent
from pipeline.model.layers.key_calibration import keys_in, queries_in
from pipeline.model.kv.layout import cache_layout, ring_runs, ring_slots
from pipeline.model.kv.quant import decode, encode, row_width, stored_dim

# both: the fused op; one alone: that half of it (custom_split.py), as ExecuTorch's llama:: ops allow
FLAGS = ({"custom_sdpa": True, "custom_kv_cache": True}, {"custom_sdpa": True, "custom_kv_cache": False},
         {"custom_sdpa": False, "custom_kv_cache": True})
FLAGS_WHY = "at least one custom op: custom_sdpa (attention over the cache), custom_kv_cache (the cache update)"
RUNTIME_OWNED = False     # the cache is in the program
KERNELS = ("llmpipe",)    # llmpipe::cached_attention.out / sdpa.out / update_cache.out: native/'s kernel library
EXECUTORCH_OPS_ONLY = False  # export may add our ops (the tied head, the experts)
LOGITS_MODES = ("full", "last", "tail", "selected")  # export.logits_mode values

NAMESPACE = "llmpipe"
OP_NAME = "cached_attention"
QUALNAME = f"{NAMESPACE}::{OP_NAME}"
READ_OP_NAME = "cached_attend"   # a KV-shared layer's read-only attend over its source layer's buffers
READ_QUALNAME = f"{NAMESPACE}::{READ_OP_NAME}"
ATTN_IMPL = "llmpipe_custom"


def cached_attention_ref(q, k, v, k_cache, v_cache, position, window: int, scale: float, sinks=None) -> torch.Tensor:
    """Reference semantics (eager): write this step into the caches in place, then attend."""
    pos, T = check_step(QUALNAME, q, k, v, position)
    slots = k_cache.shape[0]
    if window < 0:
        raise ValueError(f"{QUALNAME}: negative window {window}")
    if window == 0 and pos + T > slots:
        raise ValueError(f"{QUALNAME}: positions [{pos}, {pos + T}) exceed the cache's {slots} positions "
                         "(the max context)")
    if window > 0 and pos + T > slots and T + window - 1 > slots:  # a wrapping step must keep its window
        raise ValueError(f"{QUALNAME}: a step of {T} tokens does not fit a ring of {slots} slots "
                         f"with window {window}")
    ring = slots if window > 0 else None
    off = 0
    for slot, n in ring_runs(pos, T, ring):
        k_cache[slot:slot + n] = encode(k[0, :, off:off + n].transpose(0, 1), k_cache.dtype)
        v_cache[slot:slot + n] = encode(v[0, :, off:off + n].transpose(0, 1), v_cache.dtype)
        off += n
    base = max(0, pos - window + 1) if window > 0 else 0
    return _attend_runs(q, k_cache, v_cache, pos, base, ring, window, scale, sinks)


def _attend_runs(q, k_cache, v_cache, pos: int, base: int, ring, window: int, scale: float, sinks):
    runs = ring_runs(base, pos + q.shape[2] - base, ring)
    K = decode(torch.cat([k_cache[s:s + n] for s, n in runs])).transpose(0, 1)  # [Hkv,S,D]
    V = decode(torch.cat([v_cache[s:s + n] for s, n in runs])).transpose(0, 1)
    return attend_gathered(q, K, V, pos, base, window, scale, q.dtype, sinks)


def cached_attend_ref(q, k_cache, v_cache, position, window: int, scale: float, sinks=None) -> torch.Tensor:
    """A KV-shared layer (eager): attend over its source layer's buffers, written earlier in this forward,
    without writing; q holds the queries at `position` (possibly only the step's last rows)."""
    pos_list = position.reshape(-1).tolist()
    T, slots = q.shape[2], k_cache.shape[0]
    if len(pos_list) != T or pos_list != list(range(pos_list[0], pos_list[0] + T)):
        raise ValueError(f"{READ_QUALNAME}: position must be {T} consecutive entries, got {pos_list}")
    pos = int(pos_list[0])
    ring = slots if window > 0 else None
    if pos < 0 or (ring is None and pos + T > slots):
        raise ValueError(f"{READ_QUALNAME}: positions [{pos}, {pos + T}) exceed the cache's {slots} positions")
    base = max(0, pos - window + 1) if window > 0 else 0
    return _attend_runs(q, k_cache, v_cache, pos, base, ring, window, scale, sinks)


def _define() -> None:
    def eager(q, k, v, k_cache, v_cache, position, window, scale, sinks=None):
        return cached_attention_ref(q, k, v, k_cache, v_cache, position, int(window), float(scale), sinks)

    def fake(q, k, v, k_cache, v_cache, position, window, scale, sinks=None):
        return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))

    globals()["_LIB"] = define_op(
        NAMESPACE, OP_NAME, "Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor position, "
        "int window, float scale, Tensor? sinks=None", "c", eager, fake)


def _define_readonly() -> None:
    def eager(q, k_cache, v_cache, position, window, scale, sinks=None):
        return cached_attend_ref(q, k_cache, v_cache, position, int(window), float(scale), sinks)

    def fake(q, k_cache, v_cache, position, window, scale, sinks=None):
        return q.new_empty((q.shape[0], q.shape[1], q.shape[2], stored_dim(v_cache)))

    globals()["_LIB_READ"] = define_op(
        NAMESPACE, READ_OP_NAME, "Tensor q, Tensor k_cache, Tensor v_cache, Tensor position, int window, float scale, "
        "Tensor? sinks=None", "a", eager, fake)


if not hasattr(getattr(torch.ops, NAMESPACE), OP_NAME):
    _define()
if not hasattr(getattr(torch.ops, NAMESPACE), READ_OP_NAME):
    _define_readonly()


def fused(flags: dict) -> bool:
    return bool(flags["custom_sdpa"] and flags["custom_kv_cache"])


def exports_non_strict(flags: dict) -> bool:
    """The fused op's module (the cache ours): either op alone keeps HF's StaticCache, whose non-strict program fails
    to lower (`expected compiled_fn to be GraphModule`, found by the slow tier)."""
    return fused(flags)


def takes_rows(flags: dict) -> bool:
    """The fused op's module takes rows; either op alone wraps HF's StaticCache, which has no rows input."""
    return fused(flags)


def sdpa_with_kv_cache(flags: dict) -> bool:
    """Attention is one of our ops reading the cache (the fused op, or llmpipe::sdpa over HF's cache)."""
    return bool(flags["custom_sdpa"])


def rings(flags: dict) -> bool:
    """Only the fused op keeps rings (window + chunk - 1 slots); either op alone works on a flat cache."""
    return fused(flags)


def constant_methods(cfg, context: int, chunk: int, flags: dict) -> dict:
    """get_ring_windows / get_ring_slots (one entry per ring layer), when the program has rings; the recurrent
    layers' state (recurrent.state_methods), when it has them."""
    out = recurrent.state_methods(cfg, rings(flags))
    ring_windows = [s.window for s in cache_layout(cfg).specs if s.window > 0] if rings(flags) else []
    if not ring_windows:
        return out
    return {**out, "get_ring_windows": torch.tensor(ring_windows, dtype=torch.long),
            "get_ring_slots": torch.tensor([ring_slots(w, chunk, context) for w in ring_windows], dtype=torch.long)}


def _custom_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention-interface function: q/k arrive RoPE-rotated, [B,H,T,D]; returns ([B,T,H,Dv], None)."""
    positions, scaling = step_args("custom", query, scaling, kwargs)
    src = kv_source(module)
    if src is not module:
        # a KV-shared layer: its source wrote this step; HF may keep only the step's last rows for it
        out = torch.ops.llmpipe.cached_attend(queries_in(module, query), src.k_cache, src.v_cache,
                                              query_positions(positions, query), src.kv_window, scaling,
                                              sinks_arg(kwargs))
        return out.transpose(1, 2).contiguous(), None
    # a calibrated build's cache holds (k - m) * a, its queries enter as q / a
    # (pipeline/model/layers/key_calibration.py)
    out = torch.ops.llmpipe.cached_attention(queries_in(module, query), keys_in(module, key), value, module.k_cache,
                                             module.v_cache, positions.reshape(-1), module.kv_window, scaling,
                                             sinks_arg(kwargs))
    return out.transpose(1, 2).contiguous(), None


class CustomCacheLM(HookedAttentionLM):
    """Runner layout over an HF causal LM with an in-graph cache and one fused op per attention layer.

    Each attention module gets buffers k_cache / v_cache ([slots, Hkv, D], the activation dtype or kv_dtype; int8
    and int4 rows carry their scales, pipeline/model/kv/quant.py) and its
    window; sliding layers hold a ring of min(window + chunk - 1, context) slots. A step at any position
    overwrites what follows it, so a rerun from 0 simply starts a new sequence.
    """

    def __init__(self, model: nn.Module, max_context_len: int, logits_mode: str = "last", *,
                 prefill_chunk: Optional[int] = None, kv_dtype: Optional[torch.dtype] = None):
        super().__init__(model, logits_mode, ATTN_IMPL, _custom_attention)
        layout = cache_layout(model.config.get_text_config())
        chunk = prefill_chunk or max_context_len
        dtype = kv_dtype or next(model.parameters()).dtype
        self.slots = []
        layers = attention_layers(model)
        for m in layers:
            if layout.is_readonly(m.layer_idx):
                continue
            spec = layout.specs[layout.layer_cache[m.layer_idx]]
            slots = ring_slots(spec.window, chunk, max_context_len)
            m.kv_window = int(spec.window)
            m.register_buffer("k_cache", torch.zeros(slots, spec.kv_heads, row_width(dtype, spec.head_dim),
                                                     dtype=dtype), persistent=False)
            m.register_buffer("v_cache", torch.zeros(slots, spec.kv_heads, row_width(dtype, spec.v_dim),
                                                     dtype=dtype), persistent=False)
            self.slots.append(slots)
        link_kv_sources(layers, layout)
        # recurrent layers: their state in buffers beside the caches, the conv's in the activations' dtype
        recurrent.install_mixers(model, next(model.parameters()).dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        with recurrent.step_positions(self, positions):
            return self._logits(tokens, positions, rows)

    def cache_bytes(self) -> int:
        kv = sum(b.numel() * b.element_size() for n, b in self.named_buffers() if n.endswith(("k_cache", "v_cache")))
        return kv + sum(m.state_bytes() for m in recurrent.mixers(self))

    def reset(self) -> None:
        for n, b in self.named_buffers():
            if n.endswith(("k_cache", "v_cache")):
                b.zero_()
        for m in recurrent.mixers(self):
            m.reset()


def kv_dtype_refused(flags: dict) -> str | None:
    if fused(flags):
        return None
    return ("either op alone works on HF's static cache, in the activation dtype: cache.kv_dtype needs both "
            "custom_sdpa and custom_kv_cache")


def wrap(model: nn.Module, context: int, logits_mode: str, chunk: int, flags: dict, kv_dtype=None) -> nn.Module:
    if fused(flags):
        return CustomCacheLM(model, context, logits_mode, prefill_chunk=chunk, kv_dtype=kv_dtype)
    from pipeline.model.cache_modes import custom_split
    if flags["custom_sdpa"]:
        return custom_split.SdpaStaticCacheLM(model, context, logits_mode)
    if flags["custom_kv_cache"]:
        return custom_split.UpdateCacheLM(model, context, logits_mode)
    raise ValueError(f"cache.mode=custom needs custom_sdpa and/or custom_kv_cache, got {flags}")


def refuses_arch(arch, flags: dict) -> str | None:
    """The fused op takes sinks; either op alone attends with HF's or llmpipe::sdpa's softmax, which has none."""
    if arch.recurrent_kinds() and not fused(flags):
        return ("recurrent layers: their state is kept beside the fused op's caches (custom_sdpa and "
                "custom_kv_cache both)")
    if arch.attention.sinks and not fused(flags):
        return ("attention sinks need both custom_sdpa and custom_kv_cache (the fused op takes them; "
                "either op alone does not)")
    return None
