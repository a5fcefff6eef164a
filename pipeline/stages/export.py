"""export: torch.export of the wrapped (quantized) module, the token dimension bounded by the chunk.

    python -m pipeline recipe=tiny_llama_xnnpack

Writes program.pt2 (torch.export.save).
"""
from __future__ import annotations

import logging

import torch

from pipeline.config import v
from pipeline.progress import spinner

NAME, VERSION = "export", 1
AFTER = ("quantize",)
CONFIG_KEYS = ("export", "backend.name")  # weight-only linears take a backend-specific form
SOURCES = ("pipeline/backends",)  # backend-specific module rewrites and partitioner configs
SOURCES += ("pipeline/hf_exporter.py",)  # export.exporter=transformers

log = logging.getLogger(__name__)


def export_program(module, chunk: int, strict: bool = True):
    t = min(2, chunk)
    example = (torch.zeros((1, t), dtype=torch.long), torch.arange(t, dtype=torch.long))
    dynamic = None
    if chunk > 1:
        T = torch.export.Dim("T", min=1, max=chunk)
        dynamic = ({1: T}, {0: T})
    with torch.no_grad():
        return torch.export.export(module, example, dynamic_shapes=dynamic, strict=strict)


def run(ctx) -> dict:
    # --- export.exporter=transformers: transformers.exporters exports and lowers (pipeline/hf_exporter.py) ---
    if v(ctx.cfg.export.exporter) == "transformers":
        from pipeline import hf_exporter
        return hf_exporter.export_stage(ctx)
    # --- end export.exporter=transformers ---
    import torchao  # noqa: F401  (registers the quantized ops the program refers to)
    module = torch.load(ctx.inputs["quantize"] / "module.pt", weights_only=False)
    info = {}
    linear = v(ctx.cfg.quantize.linear)
    if v(ctx.cfg.backend.name) == "xnnpack" and linear in ("4w", "8w"):
        from pipeline.backends.xnnpack_woq import prepare_weight_only_linears
        info = prepare_weight_only_linears(module.model, 4 if linear == "4w" else 8)
        if info["mixed_linear"]:
            log.warning("%d group-wise weight-only linears run on the portable mixed_linear kernel "
                        "(XNNPACK has none for fp32 x group-wise int weights): correct but slow; "
                        "quantize.linear_group_size=0 puts them on XNNPACK", info["mixed_linear"])
    if v(ctx.cfg.backend.name) == "mlx":  # the attention ops the MLX delegate lowers
        from pipeline.backends.mlx import prepare_module
        info = prepare_module(module, v(ctx.cfg.cache.mode), ctx.cfg.export.max_context_len)
    with spinner("torch.export", ctx.progress):
        ep = export_program(module, ctx.cfg.export.prefill_chunk, ctx.cfg.export.strict)
    torch.export.save(ep, ctx.out / "program.pt2")
    return {"graph_nodes": len(ep.graph.nodes), **info}
