"""Loading HF models and wrapping them into the exportable runner layout.

Runner layout: `forward(tokens Long[1, T], positions Long[T]) -> logits [1, R, V]` where R = 1 (logits
mode `last`) or T (`full`), 1 <= T <= prefill chunk. Cache modes are the classes in WRAPPERS.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pipeline.custom_cache import CustomCacheLM
from pipeline.offgraph import OffgraphLM

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# ExecuTorch ScalarType codes, published as get_activation_dtype
SCALAR_TYPE_CODES = {"fp16": 5, "fp32": 6, "bf16": 15}
LOGITS_MODE_CODES = {"full": 0, "last": 1, "selected": 2}


def load_hf_model(model_dir: Path, dtype: str = "fp32") -> nn.Module:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], attn_implementation="sdpa")
    model.eval()
    for m in model.modules():
        # an embedding with padding_idx lowers to an op without an out variant once quantized
        if isinstance(m, nn.Embedding):
            m.padding_idx = None
    return model


def text_config(model):
    return model.config.get_text_config()


class StaticCacheLM(nn.Module):
    """HF attention over a static in-graph KV cache (mutable buffers that persist across calls).

    Sliding-window layers keep a full-length cache too: HF builds their masks from absolute positions,
    so a window is honoured exactly, at the cost of memory (rings are the off-graph cache's job).
    """

    def __init__(self, model: nn.Module, max_context_len: int, logits_mode: str = "last"):
        super().__init__()
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer

        cfg = text_config(model)
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


WRAPPERS = {"static": StaticCacheLM, "custom": CustomCacheLM, "offgraph": OffgraphLM}


def wrap(model: nn.Module, mode: str, max_context_len: int, logits_mode: str,
         prefill_chunk: int | None = None) -> nn.Module:
    try:
        cls = WRAPPERS[mode]
    except KeyError:
        raise ValueError(f"cache.mode={mode!r}: supported: {sorted(WRAPPERS)}") from None
    # rings are sized by the largest write (the chunk)
    kw = {"prefill_chunk": prefill_chunk} if mode in ("custom", "offgraph") else {}
    return cls(model, max_context_len, logits_mode, **kw).eval()


@torch.no_grad()
def run_sequence(module: nn.Module, ids: list[int], chunk: int, start: int = 0) -> torch.Tensor:
    """Feed ids through a wrapped module in chunks from `start`; returns the last position's logits [V]."""
    logits = None
    for s in range(0, len(ids), chunk):
        piece = ids[s:s + chunk]
        tokens = torch.tensor([piece], dtype=torch.long)
        positions = torch.arange(start + s, start + s + len(piece), dtype=torch.long)
        logits = module(tokens, positions)
    return logits[0, -1].float()
