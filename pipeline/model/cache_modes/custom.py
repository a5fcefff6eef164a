"""The `custom` KV-cache mode: the cache lives in the program (mutable buffers, one pair per layer) and
each attention layer calls one fused op that updates it in place and attends.

    llmpipe::cached_attention(q, k, v, k_cache!, v_cache!, position, window, scale) -> out

- q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv] (q and k RoPE-rotated); k_cache [slots,Hkv,D],
  v_cache [slots,Hkv,Dv] (slot-major, like the off-graph storage); position [T] consecutive.
- window 0: a flat cache, slot = position, keys [0, pos+T). window w > 0: a ring of
  slots = min(w + chunk - 1, max context), slot = position % slots, keys [max(0, pos-w+1), pos+T):
  sliding layers cost window + chunk - 1 positions, not the whole context. A step that wraps the
  ring must satisfy T + w - 1 <= slots (a ring as long as the context never wraps).
- Out: [1,Hq,T,Dv] in q's dtype; attention in fp32. No expanded K/V copies (GQA is an index).
- To torch.export the op mutates its cache arguments (the schema says so); ExecuTorch keeps the
  buffers in the program and calls `llmpipe::cached_attention.out` in place
  (native/src/kernels/custom_kernel.cpp, the attention core shared with the off-graph op).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pipeline.model.attention import (HookedAttentionLM, attend_gathered, attention_layers, check_step, define_op,
                                      step_args)
from pipeline.model.kv_layout import cache_layout, ring_runs, ring_slots

FLAGS = {"custom_sdpa": True, "custom_kv_cache": True}
FLAGS_WHY = "one fused op updates the in-graph cache and attends: both flags"
RUNTIME_OWNED = False     # the cache is in the program
RINGS = True              # sliding layers hold window + chunk - 1 slots
KERNELS = ("llmpipe",)    # llmpipe::cached_attention.out: native/'s kernel library
LOGITS_MODES = ("full", "last", "selected")  # export.logits_mode values

NAMESPACE = "llmpipe"
OP_NAME = "cached_attention"
QUALNAME = f"{NAMESPACE}::{OP_NAME}"
ATTN_IMPL = "llmpipe_custom"


def cached_attention_ref(q, k, v, k_cache, v_cache, position, window: int, scale: float) -> torch.Tensor:
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
        k_cache[slot:slot + n] = k[0, :, off:off + n].transpose(0, 1).to(k_cache.dtype)
        v_cache[slot:slot + n] = v[0, :, off:off + n].transpose(0, 1).to(v_cache.dtype)
        off += n
    base = max(0, pos - window + 1) if window > 0 else 0
    runs = ring_runs(base, pos + T - base, ring)
    K = torch.cat([k_cache[s:s + n] for s, n in runs]).transpose(0, 1)  # [Hkv,S,D]
    V = torch.cat([v_cache[s:s + n] for s, n in runs]).transpose(0, 1)
    return attend_gathered(q, K, V, pos, base, window, scale, q.dtype)


def _define() -> None:
    def eager(q, k, v, k_cache, v_cache, position, window, scale):
        return cached_attention_ref(q, k, v, k_cache, v_cache, position, int(window), float(scale))

    def fake(q, k, v, k_cache, v_cache, position, window, scale):
        return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))

    globals()["_LIB"] = define_op(
        NAMESPACE, OP_NAME, "Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor position, "
        "int window, float scale", "c", eager, fake)


if not hasattr(getattr(torch.ops, NAMESPACE), OP_NAME):
    _define()


def constant_methods(cfg, context: int, chunk: int) -> dict:
    """get_ring_windows / get_ring_slots (one entry per ring layer), when the model has sliding layers."""
    rings = [s.window for s in cache_layout(cfg).specs if s.window > 0]
    if not rings:
        return {}
    return {"get_ring_windows": torch.tensor(rings, dtype=torch.long),
            "get_ring_slots": torch.tensor([ring_slots(w, chunk, context) for w in rings], dtype=torch.long)}


def _custom_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention-interface function: q/k arrive RoPE-rotated, [B,H,T,D]; returns ([B,T,H,Dv], None)."""
    positions, scaling = step_args("custom", query, scaling, kwargs)
    out = torch.ops.llmpipe.cached_attention(query, key, value, module.k_cache, module.v_cache,
                                             positions.reshape(-1), module.kv_window, scaling)
    return out.transpose(1, 2).contiguous(), None


class CustomCacheLM(HookedAttentionLM):
    """Runner layout over an HF causal LM with an in-graph cache and one fused op per attention layer.

    Each attention module gets buffers k_cache / v_cache ([slots, Hkv, D], the activation dtype) and its
    window; sliding layers hold a ring of min(window + chunk - 1, context) slots. A step at any position
    overwrites what follows it, so a rerun from 0 simply starts a new sequence.
    """

    def __init__(self, model: nn.Module, max_context_len: int, logits_mode: str = "last", *,
                 prefill_chunk: Optional[int] = None):
        super().__init__(model, logits_mode, ATTN_IMPL, _custom_attention)
        layout = cache_layout(model.config.get_text_config())
        chunk = prefill_chunk or max_context_len
        dtype = next(model.parameters()).dtype
        self.slots = []
        for m in attention_layers(model):
            spec = layout.specs[layout.layer_cache[m.layer_idx]]
            slots = ring_slots(spec.window, chunk, max_context_len)
            m.kv_window = int(spec.window)
            m.register_buffer("k_cache", torch.zeros(slots, spec.kv_heads, spec.head_dim, dtype=dtype),
                              persistent=False)
            m.register_buffer("v_cache", torch.zeros(slots, spec.kv_heads, spec.v_dim, dtype=dtype),
                              persistent=False)
            self.slots.append(slots)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self._logits(tokens, positions, rows)

    def cache_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers() if n.endswith(("k_cache", "v_cache")))

    def reset(self) -> None:
        for n, b in self.named_buffers():
            if n.endswith(("k_cache", "v_cache")):
                b.zero_()


def wrap(model: nn.Module, context: int, logits_mode: str, chunk: int) -> nn.Module:
    return CustomCacheLM(model, context, logits_mode, prefill_chunk=chunk)
