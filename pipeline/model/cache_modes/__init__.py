"""The KV-cache modes, one module each; the file name is the `cache.mode` value. Each declares what contract.py's
CacheMode protocol lists, checked here at import."""
from __future__ import annotations

from pipeline.model.cache_modes import custom, offgraph, static, stock
from pipeline.model.cache_modes.contract import CacheMode
from pipeline.registry import Registry, check_contract

CACHE_MODES = Registry("cache.mode", {m.__name__.rsplit(".", 1)[-1]: m for m in (static, custom, offgraph, stock)})
check_contract(CACHE_MODES, CacheMode)


def flags(cache) -> dict:
    """cache.custom_sdpa / cache.custom_kv_cache of a cache config, as plain bools."""
    return {"custom_sdpa": bool(cache.custom_sdpa), "custom_kv_cache": bool(cache.custom_kv_cache)}


def logits_mode(cfg, tail: bool = True) -> str:
    """export.logits_mode as built. `auto`, where the cache mode's module takes a rows input: `tail` when the cache
    is in the program and the backend lowers it (a decode step computes one row; speculation's verify step its few
    rows; ExecuTorch's own runner drives it with two inputs and reads the last row), else `selected` (the batched
    runner asks rows of several sessions of a runtime-owned cache in one forward); `last` elsewhere."""
    mode = cfg.export.logits_mode
    mode = getattr(mode, "value", mode)
    if mode != "auto":
        return mode
    m = CACHE_MODES[cfg.cache.mode]
    if not m.takes_rows(flags(cfg.cache)):
        return "last"
    return "tail" if tail and not m.RUNTIME_OWNED else "selected"


def wrap(model, mode: str, context: int, logits_mode: str, chunk: int | None = None, mode_flags: dict | None = None,
         kv_dtype=None, tail_rows: int | None = None):
    """The runner-layout module of `mode` over an HF causal LM, in eval mode (rings sized by the chunk);
    mode_flags None: the mode's default flags; kv_dtype None: the K/V buffers in the model's dtype; tail_rows:
    logits mode `tail`'s most rows (None: the default)."""
    m = CACHE_MODES[mode]
    flags_ = mode_flags or m.FLAGS[0]
    if kv_dtype is not None and m.kv_dtype_refused(flags_):
        raise ValueError(f"cache.mode={mode}: {m.kv_dtype_refused(flags_)}")
    module = m.wrap(model, context, logits_mode, chunk or context, flags_, kv_dtype).eval()
    if tail_rows is not None:
        module.tail_rows = int(tail_rows)
    return module
