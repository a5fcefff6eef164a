"""The `static` KV-cache mode: HF attention over a static in-graph cache (mutable buffers that persist
across calls), masks in the graph. The program owns the cache."""
from __future__ import annotations

import torch
from torch import nn

from pipeline.model import recurrent
from pipeline.model.attention import DEFAULT_TAIL_ROWS, logits_to_keep

FLAGS = ({"custom_sdpa": False, "custom_kv_cache": False},)
FLAGS_WHY = "the custom ops are the custom mode's (cache=custom takes either or both)"
RUNTIME_OWNED = False     # the cache is in the program: no runner-side cache policy
KERNELS: tuple[str, ...] = ()
EXECUTORCH_OPS_ONLY = False  # export may add our ops (the tied head, the experts)
LOGITS_MODES = ("full", "last", "tail")  # HF logits_to_keep over a StaticCache: no rows input


def takes_rows(flags: dict) -> bool:
    return False


def sdpa_with_kv_cache(flags: dict) -> bool:
    return False  # HF's attention math over HF's cache


def attach_static_cache(owner: nn.Module, model: nn.Module, max_context_len: int):
    """HF's StaticCache of `max_context_len` positions for every layer (BHSD buffers it updates with index_copy_),
    its tensors registered as `owner`'s buffers so export keeps them in the program; returns the cache."""
    from transformers import StaticCache
    from transformers.cache_utils import DummyLayer, StaticLayer

    from pipeline.model.kv_layout import cache_layout

    cfg = model.config.get_text_config()
    cache = StaticCache(config=cfg, max_cache_len=max_context_len)
    lay = cache_layout(cfg)
    # KV-shared layers (Gemma 4) keep HF's DummyLayer: they read their source layer's K/V; a recurrent layer has none
    # (its mixer keeps its state: pipeline/model/recurrent.py)
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


class StaticCacheLM(nn.Module):
    """HF attention over a static in-graph KV cache.

    Sliding-window layers keep a full-length cache too: HF builds their masks from absolute positions,
    so a window is honoured exactly, at the cost of memory (rings are the other modes' job).
    """
    tail_rows = DEFAULT_TAIL_ROWS  # logits mode `tail`: cache_modes.wrap sets the build's

    def __init__(self, model: nn.Module, max_context_len: int, logits_mode: str = "last"):
        super().__init__()
        self.model = model
        self.logits_mode = logits_mode
        self.cache = attach_static_cache(self, model, max_context_len)
        recurrent.install_mixers(model, next(model.parameters()).dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        start_step(self.cache, positions)
        with recurrent.step_positions(self, positions):
            keep = logits_to_keep(self.logits_mode, tokens, None, self.tail_rows)
            out = self.model(input_ids=tokens, position_ids=positions.unsqueeze(0), past_key_values=self.cache,
                             use_cache=True, logits_to_keep=keep)
        return out.logits

    def reset(self) -> None:
        reset_static_cache(self.cache)
        for m in recurrent.mixers(self):
            m.reset()


def exports_non_strict(flags: dict) -> bool:
    return False  # HF's static cache exported non-strict fails to lower (`expected compiled_fn to be GraphModule`)


def rings(flags: dict) -> bool:
    return False  # sliding layers keep the whole context


def kv_dtype_refused(flags: dict) -> str | None:
    return "HF's static cache keeps the activation dtype (cache.kv_dtype is the fused custom cache's)"


def wrap(model: nn.Module, context: int, logits_mode: str, chunk: int, flags: dict, kv_dtype=None) -> nn.Module:
    return StaticCacheLM(model, context, logits_mode)


def constant_methods(cfg, context: int, chunk: int, flags: dict) -> dict:
    return recurrent.state_methods(cfg, rings=False)  # the recurrent layers' state, when the model has them


def refuses_arch(arch, flags: dict) -> str | None:
    return None  # HF's own attention (sinks too: gpt-oss's eager attention); recurrent layers keep their own state
