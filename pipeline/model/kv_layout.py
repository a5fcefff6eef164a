"""Which KV caches a model needs, and their geometry: one cache per attention layer, flat or a ring.

Shared by the cache modes that keep their own caches (custom: in the program; offgraph: in the runtime)
and by the runtimes that build an off-graph program's cache from its constant methods.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from pipeline.model.geometry import layer_types


@dataclass(frozen=True)
class LayerSpec:
    kv_heads: int
    head_dim: int
    v_dim: int
    window: int = 0  # 0 = flat (full attention)


@dataclass(frozen=True)
class CacheLayout:
    """layer -> cache index, and one LayerSpec per cache."""
    layer_cache: list[int]
    specs: list[LayerSpec]

    @property
    def n_caches(self) -> int:
        return len(self.specs)


def cache_layout(cfg, windows: Optional[Sequence[int]] = None) -> CacheLayout:
    """One cache per attention layer of an HF text config; `windows` (a pattern repeated over the caches,
    0 = flat) overrides the model's policy (a runner-side choice: never heads or dims)."""
    if getattr(cfg, "num_kv_shared_layers", 0):
        raise NotImplementedError("KV-shared layers (num_kv_shared_layers) are not supported yet")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise NotImplementedError("attention logit softcapping is not supported")
    n = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads
    types = layer_types(cfg)
    window = getattr(cfg, "sliding_window", None) or 0
    specs = []
    for i in range(n):
        w = window if types[i] == "sliding_attention" else 0
        if windows:
            w = int(windows[i % len(windows)])
        specs.append(LayerSpec(kv_heads, head_dim, head_dim, w))
    return CacheLayout(list(range(n)), specs)


def ring_slots(window: int, chunk: int, context: int) -> int:
    """Slots of a layer's cache: a ring of window + chunk - 1 (at most the context), or the context if flat."""
    return min(window + chunk - 1, context) if window > 0 else context


def ring_runs(start_pos: int, count: int, ring: Optional[int]) -> list[tuple[int, int]]:
    """Logical positions [start_pos, start_pos+count) as (physical slot, count) runs; ring None = flat."""
    if ring is None:
        return [(start_pos, count)] if count else []
    slot = start_pos % ring
    first = min(count, ring - slot)
    runs = [(slot, first)]
    if count > first:
        runs.append((0, count - first))
    return runs
