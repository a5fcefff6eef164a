"""The KV-cache modes, one module each; the file name is the `cache.mode` value.

Each module declares:
    FLAGS: dict            -- the values of cache.custom_sdpa / cache.custom_kv_cache the mode takes (FLAGS_WHY: why)
    RUNTIME_OWNED: bool    -- the runtime owns the cache (sized per run: verify.runtime, the runners' --kv-*)
    RINGS: bool            -- sliding layers hold window + chunk - 1 slots instead of the whole context
    KERNELS: tuple         -- native kernel libraries its programs call ("llmpipe": native/'s)
    LOGITS_MODES: tuple    -- the export.logits_mode values it exports (`selected`: forward takes rows Long[R])
    wrap(model, context, logits_mode, chunk) -> the runner-layout module (tokens, positions) -> logits
    constant_methods(text_config, context, chunk) -> the constant methods the mode adds to the .pte
"""
from __future__ import annotations

from pipeline.model.cache_modes import custom, offgraph, static
from pipeline.registry import Registry

CACHE_MODES = Registry("cache.mode", {m.__name__.rsplit(".", 1)[-1]: m for m in (static, custom, offgraph)})


def wrap(model, mode: str, context: int, logits_mode: str, chunk: int | None = None):
    """The runner-layout module of `mode` over an HF causal LM, in eval mode (rings sized by the chunk)."""
    return CACHE_MODES[mode].wrap(model, context, logits_mode, chunk or context).eval()
