"""calibrate: what quantization learns from data, measured once on the float model and cached apart from the
quantize stage, so a sweep over schemes reuses it.

    python -m pipeline quantize.algorithm=gptq          # the default build, its linears rounded by GPTQ

Over the calibration text (bench/corpus/calibration.txt, which nothing scores): the activation maxima smoothing
divides by (quantize.smoothing), and with quantize.algorithm=gptq each linear's Hessian X^T X / n, taken on the
smoothed model (pipeline/model/gptq.py). Writes calibration.pt ({"maxima", "hessians"}, either may be empty) and
calibration.json.
"""
from __future__ import annotations

import json

import torch

from pipeline.config import v
from pipeline.report.progress import spinner
from pipeline.store.files import write_streaming

NAME, VERSION = "calibrate", 1
AFTER = ("download", "wrap")
SOURCES = ("bench/corpus/calibration.txt",)
CONFIG_KEYS = ("quantize.smoothing", "quantize.algorithm")


def needed(q) -> bool:
    return q.smoothing is not None or v(q.algorithm) == "gptq"


def run(ctx) -> dict:
    q = ctx.cfg.quantize
    report = {"smoothing": q.smoothing, "algorithm": v(q.algorithm), "calibration_tokens": 0, "hessians": 0}
    maxima, hessians = {}, {}
    if needed(q):
        from transformers import AutoTokenizer

        from pipeline.fidelity import calibration_ids
        from pipeline.model.loading import load_hf_model
        from pipeline.model.smoothing import activation_maxima, smooth
        model_dir = ctx.inputs["download"] / "model"
        sequences = calibration_ids(AutoTokenizer.from_pretrained(model_dir))
        report["calibration_tokens"] = sum(map(len, sequences))
        model = load_hf_model(model_dir, exportable=True)
        with torch.no_grad():
            if q.smoothing is not None:
                with spinner("calibrate: activation maxima", ctx.progress):
                    maxima = activation_maxima(model, sequences)
                smooth(model, maxima, q.smoothing)
            if v(q.algorithm) == "gptq":
                from pipeline.model.gptq import hessians as measure
                with spinner("calibrate: Hessians", ctx.progress):
                    hessians = measure(model, sequences)
        report["hessians"] = len(hessians)
    write_streaming(ctx.out / "calibration.pt", lambda f: torch.save({"maxima": maxima, "hessians": hessians}, f))
    (ctx.out / "calibration.json").write_text(json.dumps(report, indent=2))
    return report
