"""The backends, one module (or package) each; the file name is the `backend.name` value. Each declares what
contract.py's Backend protocol lists, checked here at import."""
from __future__ import annotations

from pipeline.backends import mlx, portable, xnnpack
from pipeline.backends.contract import Backend
from pipeline.model import cache_modes
from pipeline.registry import Registry, check_contract

BACKENDS = Registry("backend.name", {m.__name__.rsplit(".", 1)[-1]: m for m in (xnnpack, portable, mlx)})
check_contract(BACKENDS, Backend)


def logits_mode(cfg) -> str:
    """export.logits_mode as built (pipeline/model/cache_modes logits_mode), `tail` only where the backend lowers it."""
    return cache_modes.logits_mode(cfg, tail=BACKENDS[cfg.backend.name].TAIL_LOGITS)
