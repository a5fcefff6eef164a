"""quantize: torchao schemes for linears, the lm_head and embeddings (pipeline/model/quantization.py).

    python -m pipeline recipe=tiny_llama_xnnpack_8da4w
    python -m pipeline recipe=smollm2_xnnpack quantize=8da4w quantize.algorithm=hqq

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

NAME, VERSION = "quantize", 1
AFTER = ("download", "wrap")
CONFIG_KEYS = ("quantize", "backend.name")  # whether a backend keeps asymmetric weights decides what is carried


def run(ctx) -> dict:
    module = torch.load(ctx.inputs["wrap"] / "module.pt", weights_only=False)
    gguf = ctx.inputs["download"] / SOURCE_GGUF
    source = SourceGrid(gguf) if ctx.cfg.quantize.source_grid and gguf.exists() else None
    with spinner("quantize", ctx.progress), torch.no_grad():
        report = quantize_module(module, ctx.cfg.quantize, source,
                                 BACKENDS[ctx.cfg.backend.name].ASYMMETRIC_WEIGHTS)
    torch.save(module, ctx.out / "module.pt")
    (ctx.out / "quantize.json").write_text(json.dumps(report, indent=2))
    return report
