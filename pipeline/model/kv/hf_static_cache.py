"""HF's StaticCache held in a program: its tensors as buffers of the wrapper, where a step starts, a reset. The `static`
mode runs HF's attention over it; the custom mode's split form (cache_modes/custom_split.py) reuses it for the half it
leaves to HF."""
from __future__ import annotations

import torch
from torch import nn


def attach_static_cache(owner: nn.Module, model: nn.Module, max_context_len: int):
    """HF's StaticCache of `max_context_len` positions for every layer (BHSD buffers it updates with index_copy_),
    its tensors registered as `owner`'s buffers so export keeps them in the program; returns the cache."""
    from transformers import StaticCache
    from transformers.cache_utils import DummyLayer, StaticLayer

    from pipeline.model.kv.layout import cache_layout

    cfg = model.config.get_text_config()
    cache = StaticCache(config=cfg, max_cache_len=max_context_len)
    lay = cache_layout(cfg)
    # KV-shared layers (Gemma 4) keep HF's DummyLayer: they read their source layer's K/V; a recurrent layer has none
    # (its mixer keeps its state: pipeline/model/layers/recurrent.py)
    cache.layers = [layer if isinstance(layer, DummyLayer) else DummyLayer() if c < 0 else StaticLayer(max_context_len)
                    for layer, c in zip(cache.layers, lay.layer_cache)]
    specs = [lay.specs[c] for c in lay.layer_cache]  # a recurrent layer (-1): any, its DummyLayer holds nothing
    dtype = next(model.parameters()).dtype
    cache.early_initialization(1, [s.kv_heads for s in specs], [s.head_dim for s in specs], dtype,
                               torch.device("cpu"))
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DummyLayer):
            continue
        owner.register_buffer(f"k_cache_{i}", layer.keys, persistent=False)
        owner.register_buffer(f"v_cache_{i}", layer.values, persistent=False)
        owner.register_buffer(f"cache_len_{i}", layer.cumulative_length, persistent=False)
    return cache


def buffer_layers(cache) -> list:
    """The cache layers with buffers (a KV-shared layer's DummyLayer has none)."""
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]


def start_step(cache, positions: torch.Tensor) -> None:
    """The caller says where this chunk starts: a rerun from position 0 starts a new sequence."""
    for layer in buffer_layers(cache):
        layer.cumulative_length.copy_(positions[0])


def reset_static_cache(cache) -> None:
    for layer in buffer_layers(cache):
        layer.keys.zero_()
        layer.values.zero_()
        layer.cumulative_length.zero_()
