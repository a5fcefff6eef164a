"""calibrate: what quantization learns from data, measured once on the float model and cached apart from the
quantize stage, so a sweep over schemes reuses it.

    python -m pipeline quantize.algorithm=gptq          # the default build, its linears rounded by GPTQ

Over the calibration set (pipeline/corpus.py: eight domains of bench/corpus, chats through the model's own template;
no held-out text): the activation maxima smoothing divides by (quantize.smoothing), and with quantize.algorithm=gptq
each linear's Hessian X^T X / n of the smoothed model (pipeline/model/quant/gptq.py): measured in the same pass as
the maxima and rescaled by smoothing's divisors, H / (s s^T), as the smoothed model computes the same function; with
quantize.target_bpw each planned linear's KLD cost at each scheme the backend offers, on a row of each domain
(pipeline/model/quant/allocate.py). Writes calibration.pt ({"maxima", "hessians", "sensitivity"}, any may be
empty) and calibration.json, which names the files it read by sha256.
"""
from __future__ import annotations

import json

import torch

from pipeline.config import v
from pipeline.report.progress import spinner
from pipeline.store.files import write_streaming

NAME, VERSION = "calibrate", 4  # 2: one pass for maxima and Hessians; 3: the calibration set of eight domains;
# 4: the sensitivity pass samples every domain
AFTER = ("download", "wrap")
SOURCES = ("bench/corpus/corpus.json", "bench/corpus/calibration", "bench/corpus/calibration.txt")
CONFIG_KEYS = ("quantize.smoothing", "quantize.algorithm", "quantize.target_bpw", "quantize.overrides",
               "backend.name")


def config_view(cfg) -> dict:
    """What the entry depends on: the sensitivities depend on whether a target is set, not on its value (a sweep over
    quantize.target_bpw measures them once), and on the overrides and the backend only then."""
    from pipeline.store.key import config_slice
    view = config_slice(cfg, ("quantize.smoothing", "quantize.algorithm"))
    if cfg.quantize.target_bpw is not None:
        view.update(config_slice(cfg, ("quantize.overrides", "backend.name")), sensitivity=True)
    return view


def needed(q) -> bool:
    return q.smoothing is not None or v(q.algorithm) == "gptq" or q.target_bpw is not None


def run(ctx) -> dict:
    q = ctx.cfg.quantize
    report = {"smoothing": q.smoothing, "algorithm": v(q.algorithm), "calibration_tokens": 0, "hessians": 0}
    maxima, hessians, sensitivity = {}, {}, {}
    if needed(q):
        from transformers import AutoTokenizer

        from pipeline.corpus import calibration_heads, calibration_ids, calibration_record
        from pipeline.model.layers.exportable import make_exportable
        from pipeline.model.loading import load_hf_model
        from pipeline.model.quant.gptq import rescaled
        from pipeline.model.quant.smoothing import smooth
        model_dir = ctx.inputs["download"] / "model"
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        sequences = calibration_ids(tokenizer)
        report["calibration_tokens"] = sum(map(len, sequences))
        report["calibration_files"] = calibration_record()
        model = load_hf_model(model_dir)
        make_exportable(model)
        with torch.no_grad():
            if q.smoothing is not None or v(q.algorithm) == "gptq":
                what = " and ".join(["activation maxima"] * (q.smoothing is not None) +
                                    ["Hessians"] * (v(q.algorithm) == "gptq"))
                with spinner(f"calibrate: {what}", ctx.progress):
                    maxima, hessians = measure(model, sequences, q.smoothing is not None, v(q.algorithm) == "gptq")
            if q.smoothing is not None:
                scales = {}
                smooth(model, maxima, q.smoothing, scales)
                hessians = rescaled(hessians, scales)  # the smoothed model's: its linears' inputs divided by scales
            if q.target_bpw is not None:
                from pipeline.backends import BACKENDS
                from pipeline.model.quant.allocate import ROW_TOKENS, planned, sensitivities
                from pipeline.model.quant.apply import linear_roles
                algorithm = "hqq" if v(q.algorithm) == "gptq" else v(q.algorithm)  # GPTQ per trial would be slow
                with spinner("calibrate: each linear's KLD cost at each scheme", ctx.progress):
                    sensitivity = sensitivities(model, calibration_heads(tokenizer, ROW_TOKENS),
                                                planned(model, q, linear_roles(model)),
                                                BACKENDS[ctx.cfg.backend.name].PLAN_CANDIDATES, algorithm)
        report["hessians"], report["sensitivity_linears"] = len(hessians), len(sensitivity)
    write_streaming(ctx.out / "calibration.pt", lambda f: torch.save(
        {"maxima": maxima, "hessians": hessians, "sensitivity": sensitivity}, f))
    (ctx.out / "calibration.json").write_text(json.dumps(report, indent=2))
    return report


def measure(model, sequences: list[list[int]], maxima: bool, hessians: bool) -> tuple[dict, dict]:
    """Smoothing's activation maxima and GPTQ's Hessians of the float model, over one pass of uncached forwards."""
    from pipeline.model.quant.gptq import HessianSums
    from pipeline.model.quant.smoothing import MaximaRecorder
    recorder = MaximaRecorder(model) if maxima else None
    sums = HessianSums(model) if hessians else None
    # nothing here reads the logits: the head's pre-hooks still see its input (its Hessian), but its product with
    # the vocabulary (a fifth of SmolLM2's forward, most of gemma3's) is skipped, an instance forward shadowing the
    # class's; what follows the head in a forward is elementwise, and takes the empty logits
    head = model.get_output_embeddings()
    if head is not None:
        head.forward = lambda x: x[..., :0]
    try:
        for ids in sequences:
            if sums is not None:
                sums.next_forward()
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        if head is not None:
            del head.forward
        found = recorder.close() if recorder is not None else {}
        h = sums.close() if sums is not None else {}
    return found, h
