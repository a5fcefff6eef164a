"""quantize: torchao schemes for linears, the lm_head and embeddings (pipeline/model/quant/apply.py).

    python -m pipeline recipe=tiny_llama_xnnpack_8da4w
    python -m pipeline recipe=smollm2_xnnpack quantize=8da4w quantize.algorithm=hqq

With quantize.smoothing, activation outliers are moved into the weights first (pipeline/model/quant/smoothing.py); with
quantize.algorithm=gptq the int linears are rounded by GPTQ (pipeline/model/quant/gptq.py). Both read what the calibrate
stage measured. Writes module.pt (the quantized eager module), quantize.json (what was quantized, how) and with smoothing
smoothing.pt (each linear's scales).
"""
from __future__ import annotations

import json

import torch

from pipeline.backends import BACKENDS
from pipeline.config import v
from pipeline.model.quant.apply import quantize_module
from pipeline.model.quant.smoothing import SCALES_FILE
from pipeline.model.quant.source_grid import SourceGrid
from pipeline.report.progress import spinner
from pipeline.stages.download import SOURCE_GGUF
from pipeline.store.files import write_streaming

NAME, VERSION = "quantize", 2
AFTER = ("download", "wrap", "calibrate")
CONFIG_KEYS = ("quantize", "backend.name")  # whether a backend keeps asymmetric weights decides what is carried


def run(ctx) -> dict:
    q = ctx.cfg.quantize
    module = torch.load(ctx.inputs["wrap"] / "module.pt", weights_only=False)
    gguf = ctx.inputs["download"] / SOURCE_GGUF
    source = SourceGrid(gguf) if q.source_grid and gguf.exists() else None
    calibration = torch.load(ctx.inputs["calibrate"] / "calibration.pt", weights_only=True)
    smoothing = None
    if q.smoothing is not None:
        from pipeline.model.quant.smoothing import smooth
        inputs, rows = {}, {}
        smoothing = {"alpha": q.smoothing,
                     "linears": smooth(module.model, calibration["maxima"], q.smoothing, inputs, rows)}
        # what each linear's input (and output rows) are now divided by: an adapter kept apart follows them
        torch.save({"input": inputs, "rows": rows}, ctx.out / SCALES_FILE)
    plan = None
    if q.target_bpw is not None:
        from pipeline.model.quant import allocate
        from pipeline.model.quant.apply import linear_roles
        plan = allocate.plan_for(module.model, q, calibration["sensitivity"], linear_roles(module.model),
                                 BACKENDS[ctx.cfg.backend.name])
        plan["recipe"] = allocate.snippet(plan, (v(q.linear), q.linear_group_size))
    with spinner("quantize", ctx.progress), torch.no_grad():
        report = quantize_module(module, q, source, BACKENDS[ctx.cfg.backend.name].ASYMMETRIC_WEIGHTS,
                                 calibration["hessians"] or None, plan and plan["linears"])
    report["smoothing"] = smoothing
    report["plan"] = plan
    write_streaming(ctx.out / "module.pt", lambda f: torch.save(module, f))
    (ctx.out / "quantize.json").write_text(json.dumps(report, indent=2))
    return report
