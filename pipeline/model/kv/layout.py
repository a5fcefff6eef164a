"""Which KV caches a model needs, and their geometry: one cache per attention layer, flat or a ring.

Shared by the cache modes that keep their own caches (custom: in the program; offgraph: in the runtime),
by the runtimes that build an off-graph program's cache from its constant methods, and by preflight's
KV-cache estimate (geometry_layout: the same layout from the model's Geometry).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from pipeline.model import archs
from pipeline.model.geometry import Geometry, kv_sources, layer_config, layer_types


@dataclass(frozen=True)
class LayerSpec:
    kv_heads: int
    head_dim: int
    v_dim: int
    window: int = 0  # 0 = flat (full attention)


@dataclass(frozen=True)
class CacheLayout:
    """layer -> cache index, and one LayerSpec per cache. A KV-shared layer (Gemma 4's trailing
    `num_kv_shared_layers`) has no cache of its own: it maps to its source layer's cache and only reads it. A
    recurrent layer (archs.RECURRENT_KINDS) has no K/V: it maps to -1 (its state: model/layers/recurrent.py); a
    `hybrid` layer (Falcon-H1) has both; an MLP block (Nemotron-H) neither."""
    layer_cache: list[int]
    specs: list[LayerSpec]
    readonly: list[bool] = field(default_factory=list)  # per layer: attends over another layer's cache

    @property
    def n_caches(self) -> int:
        return len(self.specs)

    @property
    def n_shared(self) -> int:
        return sum(self.readonly)

    def is_readonly(self, layer: int) -> bool:
        return bool(self.readonly) and self.readonly[layer]


def _layer_dims(cfg, i: int) -> tuple[int, int]:
    """(kv heads, head dim) of layer i; a heterogeneous config (Gemma 4's global layers) has its own per layer."""
    lc = layer_config(cfg, i)
    return getattr(lc, "num_key_value_heads", None) or cfg.num_attention_heads, archs.lookup(cfg.model_type).head_dim(lc)


def cache_layout(cfg, windows: Optional[Sequence[int]] = None) -> CacheLayout:
    """One cache per attention layer of an HF text config that computes its own K/V (KV-shared layers read
    their source's); `windows` (a pattern repeated over the caches, 0 = flat) overrides the model's policy
    (a runner-side choice: never heads or dims, and a shared layer follows its source's cache)."""
    if getattr(cfg, "attn_logit_softcapping", None):
        raise NotImplementedError("attention logit softcapping is not supported")
    types = layer_types(cfg)
    sources = kv_sources(types, getattr(cfg, "num_kv_shared_layers", 0) or 0)
    dims = [_layer_dims(cfg, i) for i in range(cfg.num_hidden_layers)]
    return _layout(types, getattr(cfg, "sliding_window", None) or 0, sources, dims, windows)


def geometry_layout(g: Geometry) -> CacheLayout:
    """The same layout from a preflight Geometry (read without the HF config): per-layer heads and dims, KV sources."""
    n = g.num_layers
    dims = [(g.layer_kv_head_count(i), g.layer_head_dim(i)) for i in range(n)]
    return _layout(g.layer_types or ["full_attention"] * n, g.sliding_window or 0, g.kv_source or list(range(n)), dims)


def _layout(types: Sequence[str], window: int, sources: Sequence[int], dims: Sequence[tuple[int, int]],
            windows: Optional[Sequence[int]] = None) -> CacheLayout:
    """Per layer: its type, its K/V source layer, its (kv heads, head dim). Values are as wide as keys (Gemma 4's
    attention_k_eq_v layers too: their values are the normed, unrotated keys, stored apart)."""
    specs, layer_cache = [], []
    for i, t in enumerate(types):
        if t in archs.RECURRENT_KINDS + archs.MLP_KINDS:
            layer_cache.append(-1)
            continue
        if sources[i] != i:
            layer_cache.append(layer_cache[sources[i]])
            continue
        w = window if t == "sliding_attention" else 0
        if windows:
            w = int(windows[len(specs) % len(windows)])
        heads, dim = dims[i]
        layer_cache.append(len(specs))
        specs.append(LayerSpec(heads, dim, dim, w))
    return CacheLayout(layer_cache, specs, [sources[i] != i for i in range(len(types))])


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
