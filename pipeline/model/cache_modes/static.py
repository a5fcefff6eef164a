"""The `static` KV-cache mode: HF attention over a static in-graph cache (mutable buffers that persist
across calls), masks in the graph. The program owns the cache."""
from __future__ import annotations

import torch
from torch import nn

FLAGS = {"custom_sdpa": False, "custom_kv_cache": False}
FLAGS_WHY = "the custom ops are the custom mode's (one fused op over an in-graph cache)"
RUNTIME_OWNED = False     # the cache is in the program: no runner-side cache policy
RINGS = False             # sliding layers keep the whole context
KERNELS: tuple[str, ...] = ()
LOGITS_MODES = ("full", "last")  # HF logits_to_keep over a StaticCache: no rows input


class StaticCacheLM(nn.Module):
    """HF attention over a static in-graph KV cache.

    Sliding-window layers keep a full-length cache too: HF builds their masks from absolute positions,
    so a window is honoured exactly, at the cost of memory (rings are the other modes' job).
    """

    def __init__(self, model: nn.Module, max_context_len: int, logits_mode: str = "last"):
        super().__init__()
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        cfg = model.config.get_text_config()
        self.model = model
        self.logits_mode = logits_mode
        self.cache = StaticCache(config=cfg, max_cache_len=max_context_len)
        self.cache.layers = [StaticLayer(max_context_len) for _ in self.cache.layers]
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        self.cache.early_initialization(1, cfg.num_key_value_heads, head_dim, dtype, torch.device("cpu"))
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"k_cache_{i}", layer.keys, persistent=False)
            self.register_buffer(f"v_cache_{i}", layer.values, persistent=False)
            self.register_buffer(f"cache_len_{i}", layer.cumulative_length, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # the caller says where this chunk starts: a rerun from position 0 starts a new sequence
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(positions[0])
        out = self.model(input_ids=tokens, position_ids=positions.unsqueeze(0), past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1 if self.logits_mode == "last" else 0)
        return out.logits

    def reset(self) -> None:
        for layer in self.cache.layers:
            layer.keys.zero_()
            layer.values.zero_()
            layer.cumulative_length.zero_()


def wrap(model: nn.Module, context: int, logits_mode: str, chunk: int) -> nn.Module:
    return StaticCacheLM(model, context, logits_mode)


def constant_methods(cfg, context: int, chunk: int) -> dict:
    return {}
