"""export: the program's capture, by the route of `export.exporter` (pipeline/exporters/<name>.py).

    python -m pipeline recipe=tiny_llama_xnnpack                 # native: torch.export, T in [1, chunk]
    python -m pipeline recipe=tiny_llama_hf_exporter             # transformers: prefill.pte + decode.pte

Writes program.pt2 (native) or the exporter's folder (transformers).
"""
from __future__ import annotations

from pipeline.exporters import EXPORTERS

NAME, VERSION = "export", 1
AFTER = ("quantize",)
CONFIG_KEYS = ("export", "backend.name")  # weight-only linears take a backend-specific form


def config_view(cfg) -> dict:
    """Its keys, and an adapter kept apart by its files' hashes (it joins the program here)."""
    from pipeline.model import adapter
    from pipeline.stages.download import adapter_hashes
    from pipeline.store.key import config_slice
    view = config_slice(cfg, CONFIG_KEYS)
    if adapter.separate(cfg):
        view["adapter_files"] = adapter_hashes(cfg.model.adapter)
    return view


def run(ctx) -> dict:
    return EXPORTERS[ctx.cfg.export.exporter].export(ctx)
