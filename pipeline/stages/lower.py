"""lower: the backend's partitioning and the program files, by the route of `export.exporter`.

    python -m pipeline recipe=tiny_llama_xnnpack backend=portable

Backends are pipeline/backends/<name> (xnnpack, portable, mlx). Writes model.pte (or the transformers route's
pair) and lower.json: the program record pipeline/runtimes opens, the constant methods, delegation by op.
"""
from __future__ import annotations

from pipeline.exporters import EXPORTERS

NAME, VERSION = "lower", 1
AFTER = ("download", "export")
CONFIG_KEYS = ("backend",)


def run(ctx) -> dict:
    return EXPORTERS[ctx.cfg.export.exporter].lower(ctx)
