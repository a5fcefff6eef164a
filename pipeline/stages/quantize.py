"""quantize: torchao schemes for linears, the lm_head and embeddings (pipeline/model/quantization.py).

    python -m pipeline recipe=tiny_llama_xnnpack_8da4w
    python -m pipeline recipe=smollm2_xnnpack quantize=8da4w quantize.algorithm=hqq

With quantize.smoothing, activation outliers are moved into the weights first (pipeline/model/smoothing.py).
Writes module.pt (the quantized eager module) and quantize.json (what was quantized, how).
"""
from __future__ import annotations

import json

import torch

from pipeline.backends import BACKENDS
from pipeline.model.quantization import quantize_module
from pipeline.model.source_grid import SourceGrid
from pipeline.report.progress import spinner
from pipeline.stages.download import SOURCE_GGUF
from pipeline.store.files import write_streaming

NAME, VERSION = "quantize", 1
AFTER = ("download", "wrap")
SOURCES = ("bench/corpus/calibration.txt",)  # quantize.smoothing's calibration text
CONFIG_KEYS = ("quantize", "backend.name")  # whether a backend keeps asymmetric weights decides what is carried


def run(ctx) -> dict:
    q = ctx.cfg.quantize
    module = torch.load(ctx.inputs["wrap"] / "module.pt", weights_only=False)
    gguf = ctx.inputs["download"] / SOURCE_GGUF
    source = SourceGrid(gguf) if q.source_grid and gguf.exists() else None
    smoothing = None
    if q.smoothing is not None:
        with spinner("smoothing: calibrate", ctx.progress):
            smoothing = smooth_module(module, ctx.inputs["download"] / "model", q.smoothing)
    with spinner("quantize", ctx.progress), torch.no_grad():
        report = quantize_module(module, q, source, BACKENDS[ctx.cfg.backend.name].ASYMMETRIC_WEIGHTS)
    report["smoothing"] = smoothing
    write_streaming(ctx.out / "module.pt", lambda f: torch.save(module, f))
    (ctx.out / "quantize.json").write_text(json.dumps(report, indent=2))
    return report


def smooth_module(module, model_dir, alpha: float) -> dict:
    """Smooth the wrapped model's linears with maxima measured on the float model over the calibration text."""
    from transformers import AutoTokenizer

    from pipeline.fidelity import calibration_ids
    from pipeline.model.loading import load_hf_model
    from pipeline.model.smoothing import activation_maxima, smooth
    sequences = calibration_ids(AutoTokenizer.from_pretrained(model_dir))
    maxima = activation_maxima(load_hf_model(model_dir, exportable=True), sequences)
    linears = smooth(module.model, maxima, alpha)
    return {"alpha": alpha, "calibration_tokens": sum(map(len, sequences)), "linears": linears}
