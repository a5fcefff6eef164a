"""The KV-cache modes, one module each; the file name is the `cache.mode` value.

Each module declares:
    FLAGS: tuple[dict]     -- the combinations of cache.custom_sdpa / cache.custom_kv_cache the mode takes, the
                              first its default (FLAGS_WHY: why)
    RUNTIME_OWNED: bool    -- the runtime owns the cache (sized per run: verify.runtime, the runners' --kv-*)
    KERNELS: tuple         -- native kernel libraries its programs call ("llmpipe": native/'s; "llama": ExecuTorch's
                              LLM custom ops, pipeline/ops.py)
    EXECUTORCH_OPS_ONLY: bool -- its programs call ExecuTorch's operators alone: export adds none of ours (the tied
                              head's llmpipe::tied_head, the experts' llmpipe::experts)
    rings(flags) -> bool   -- sliding layers hold window + chunk - 1 slots instead of the whole context
    exports_non_strict(flags) -> bool -- its module exports non-strict to a program that lowers (export.strict: null)
    LOGITS_MODES: tuple    -- the export.logits_mode values it exports (`selected`: forward takes rows Long[R])
    takes_rows(flags) -> bool -- its module takes the rows input (export.logits_mode=auto is `tail` or `selected`
                              there: logits_mode below)
    sdpa_with_kv_cache(flags) -> bool -- attention is one custom op over the cache (ExecuTorch's runner metadata)
    kv_dtype_refused(flags) -> str | None -- why the mode cannot store its K/V as cache.kv_dtype says (None: it can)
    refuses_arch(arch, flags) -> str | None -- why the mode cannot build a model of this architecture's entry
    wrap(model, context, logits_mode, chunk, flags, kv_dtype) -> the runner-layout module (tokens, positions) ->
                              logits (kv_dtype: a torch dtype for the K/V buffers, or None)
    constant_methods(text_config, context, chunk, flags) -> the constant methods the mode adds to the .pte
"""
from __future__ import annotations

from pipeline.model.cache_modes import custom, offgraph, static, stock
from pipeline.registry import Registry

CACHE_MODES = Registry("cache.mode", {m.__name__.rsplit(".", 1)[-1]: m for m in (static, custom, offgraph, stock)})


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
