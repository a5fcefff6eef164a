"""The `static` KV-cache mode: HF attention over a static in-graph cache (mutable buffers that persist
across calls), masks in the graph. The program owns the cache."""
from __future__ import annotations

import torch
from torch import nn

from pipeline.model.layers import recurrent
from pipeline.model.layers.attention import DEFAULT_TAIL_ROWS, logits_to_keep
from pipeline.model.kv.hf_static_cache import attach_static_cache, reset_static_cache, start_step

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
