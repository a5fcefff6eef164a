"""wrap: the exportable runner-layout module for the cache mode, checked against HF's uncached forward.

    python -m pipeline recipe=tiny_gemma3_xnnpack       # sliding-window layers, prompts past the window

Writes module.pt (the wrapped eager module, pickled) and wrap.json (layout and the self-check figures).
"""
from __future__ import annotations

import json
import logging
from typing import NamedTuple

import torch
from transformers import AutoTokenizer

from pipeline.abi import KV_DTYPES
from pipeline.config import v
from pipeline.backends import BACKENDS, logits_mode as resolve_logits_mode
from pipeline.corpus import calibration_ids, calibration_record
from pipeline.model import archs
from pipeline.model.cache_modes import CACHE_MODES, flags, wrap
from pipeline.model.layers import key_calibration, routing_replay
from pipeline.model.layers.exportable import make_exportable
from pipeline.model.loading import load_hf_model
from pipeline.report.progress import spinner
from pipeline.runtimes.base import run_sequence
from pipeline.store.files import write_streaming

NAME, VERSION = "wrap", 3
AFTER = ("download",)
# backend.name: export.logits_mode=auto resolves by the backend (tail only where it lowers it)
CONFIG_KEYS = ("cache", "export.max_context_len", "export.prefill_chunk", "export.dtype", "export.logits_mode",
               "export.tail_rows", "backend.name")
# the wrapper must reproduce HF's own forward this closely, relative to the logits' scale (the largest |logit| of
# the rows compared, at least 10): a half-precision forward rounds every op to its own epsilon (bf16 2^-8), and the
# two forwards round in different orders, more so over the long check (measured, wrap.json "self_check": SmolLM2 and
# gemma3 at bf16, 640 tokens in chunks of 512, 0.022-0.024 of the scale, 3 to 6 bf16 steps; README: Half precision).
# int8 K/V rows round each element to 1/254 of its group's largest (32 values), coarser than bf16 for most; int4 rows
# to 1/14 (measured: the tiny Gemma 3 and Llama at 0.062 and 0.029 of the scale; a wrong slot or head is of the
# order of the scale itself)
SELF_CHECK_TOL = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 5e-2, "int8": 5e-2, "int4": 0.15}
SCALE_FLOOR = 10.0

log = logging.getLogger(__name__)


def run(ctx) -> dict:
    e, g = ctx.cfg.export, ctx.geometry
    model_dir = ctx.inputs["download"] / "model"
    with spinner("load model", ctx.progress):
        model = load_hf_model(model_dir, v(e.dtype))
    with spinner("HF forward (the self-check's reference)", ctx.progress):
        reference = hf_reference(model, e.max_context_len, e.prefill_chunk, g.sliding_window, g.vocab_size)
    rewritten = make_exportable(model)  # after HF's own forward gave the reference: the check covers the rewrites
    mode = v(ctx.cfg.cache.mode)
    logits_mode = resolve_logits_mode(ctx.cfg)
    dtype = v(e.dtype)
    kv_dtype = ctx.cfg.cache.kv_dtype
    calibrated = calibrate_keys(ctx.cfg, archs.of_model(model))
    stats = {}
    if calibrated:
        with spinner("key statistics over the calibration corpus", ctx.progress):
            n = min(key_calibration.TOKENS_PER_DOMAIN, e.max_context_len)  # every position within the context
            stats = key_calibration.measure(model, calibration_ids(AutoTokenizer.from_pretrained(model_dir), n, n),
                                            e.max_context_len)
    module = wrap(model, mode, e.max_context_len, logits_mode, e.prefill_chunk, flags(ctx.cfg.cache),
                  KV_DTYPES[v(kv_dtype)] if kv_dtype is not None else None, tail_rows=e.tail_rows)
    key_calibration.install(stats, next(model.parameters()).dtype)
    with spinner("self-check against HF forward", ctx.progress):
        check = compare(module, reference, e.prefill_chunk)
    # K/V storage (cache.kv_dtype) rounds as its own dtype does
    rounding = max(SELF_CHECK_TOL[dtype], SELF_CHECK_TOL[v(kv_dtype)] if kv_dtype is not None else 0.0)
    tol = rounding * max(check["logit_scale"], SCALE_FLOOR)
    if check["max_abs_err"] > tol:
        raise RuntimeError(f"wrapped module disagrees with HF forward: max abs logit error "
                           f"{check['max_abs_err']:.3g} > {tol:.3g} ({rounding} x the logits' scale "
                           f"{check['logit_scale']:.3g}, {dtype}) over {check['tokens']} tokens")
    module.reset()
    write_streaming(ctx.out / "module.pt", lambda f: torch.save(module, f))
    spec = {
        "cache_mode": mode, "cache_flags": flags(ctx.cfg.cache), "max_context_len": e.max_context_len, "prefill_chunk": e.prefill_chunk,
        "dtype": dtype, "logits_mode": logits_mode, "tail_rows": e.tail_rows, "layer_types": g.layer_types,
        "sliding_window": g.sliding_window, "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim,
        "vocab_size": g.vocab_size, "arch": g.arch, "rewrites": rewritten, "self_check": check,
        "calibrate_keys": calibrated,
    }
    (ctx.out / "wrap.json").write_text(json.dumps(spec, indent=2))
    metrics = {"self_check_max_abs_err": check["max_abs_err"], "self_check_tokens": check["tokens"],
               "calibrate_keys": calibrated}
    if calibrated:  # what the key transform was measured on, by hash
        metrics["calibration_files"] = calibration_record()
    return metrics


def calibrate_keys(cfg, arch) -> bool:
    """cache.calibrate_keys, resolved for this build (pipeline/model/layers/key_calibration.py)."""
    m, kv_dtype = CACHE_MODES[cfg.cache.mode], cfg.cache.kv_dtype
    fused_op = m.RUNTIME_OWNED or m.kv_dtype_refused(flags(cfg.cache)) is None
    return key_calibration.wanted(cfg.cache.calibrate_keys, fused_op, m.RUNTIME_OWNED, v(kv_dtype) if kv_dtype is not None else None,
                                  "int4" in BACKENDS[cfg.backend.name].KV_STORAGES, arch)


@torch.no_grad()
class Reference(NamedTuple):
    ids: list[int]
    kept: torch.Tensor        # HF's logits of the rows compared
    prefill: int              # the prefill length; the rest are decoded one at a time
    model: torch.nn.Module    # HF's model, whose mixture-of-experts routers replay `routing`
    routing: list             # each router's choices in HF's forward (routing_replay.recorded)


@torch.no_grad()
def hf_reference(model, context: int, chunk: int, window, vocab: int) -> Reference:
    """One uncached HF forward over random ids that run past the sliding window (when the context allows), so window
    masks are exercised. Only the rows compared are kept: the last prefill row and the 4 decoded ones (all n rows of
    gemma's vocabulary: 0.7 GB)."""
    n = min(context, (window or 0) + 2 * chunk + 4, 640)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
    prefill = n - 4
    with routing_replay.recorded(model) as routing:
        kept = model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=n - prefill + 1).logits[0].float()
    return Reference(ids, kept, prefill, model, routing)


def self_check(module, model, context: int, chunk: int, window, vocab: int) -> dict:
    """The wrapper against its model's uncached forward, past the window (hf_reference, then compare)."""
    return compare(module, hf_reference(model, context, chunk, window, vocab), chunk)


@torch.no_grad()
def compare(module, ref: Reference, chunk: int) -> dict:
    """Chunked prefill + decode through the wrapper vs HF's uncached forward over the same ids (hf_reference), on
    HF's routing (routing_replay: a router's near-tie must not decide the check)."""
    ids, kept, prefill = ref.ids, ref.kept, ref.prefill
    with routing_replay.replayed(ref.model, ref.routing) as routed:
        errs = [(run_sequence(module, ids[:prefill], chunk) - kept[0]).abs().max().item()]
        for i in range(prefill, len(ids)):
            step = run_sequence(module, [ids[i]], 1, start=i)
            errs.append((step - kept[i - prefill + 1]).abs().max().item())
    check = {"tokens": len(ids), "max_abs_err": max(errs), "logit_scale": kept.abs().max().item()}
    return check | routed if routed["routed_rows"] else check
