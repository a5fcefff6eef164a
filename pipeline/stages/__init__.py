"""The stages, their order and allowed predecessors, as data.

Every stage module exposes the same interface:
    NAME: str, VERSION: int            -- bump VERSION when the output format changes
    AFTER: tuple[str, ...]             -- stages whose outputs it reads (must run before it)
    CONFIG_KEYS: tuple[str, ...]       -- config slices that determine its output (the cache key)
    run(ctx: StageContext) -> dict     -- writes into ctx.out, returns metrics for the manifest
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import Stage
from pipeline.stages import calibrate, download, export, lower, quantize, verify, wrap

STAGES = {m.NAME: m for m in (download, wrap, calibrate, quantize, export, lower, verify)}
ORDER = tuple(s.value for s in Stage)  # the schema's list (run.until's choices) is the order


@dataclass
class StageContext:
    cfg: Any                          # the resolved DictConfig
    out: Path                         # the temp dir this stage writes into
    inputs: dict[str, Path]           # upstream stage name -> published entry dir
    geometry: Any = None
    build_hash: str = ""
    progress: bool = True
    info: dict = field(default_factory=dict)  # extra facts for the manifest (e.g. resolved revision)


def validate_order(order: tuple[str, ...] = ORDER) -> None:
    """Each stage's predecessors must appear earlier in the sequence."""
    seen: set[str] = set()
    for name in order:
        if name not in STAGES:
            raise ValueError(f"stage {name!r} unknown. Supported: {sorted(STAGES)}")
        missing = [p for p in STAGES[name].AFTER if p not in seen]
        if missing:
            raise ValueError(f"stage {name!r} needs {missing} before it in {list(order)}")
        seen.add(name)


def with_prerequisites(stages) -> tuple[str, ...]:
    """The stages asked for and every stage they read, transitively, in ORDER."""
    need = set(stages)
    for name in reversed(ORDER):
        if name in need:
            need.update(STAGES[name].AFTER)
    return tuple(n for n in ORDER if n in need)


validate_order()
if set(ORDER) != set(STAGES):
    raise ValueError(f"stage modules {sorted(STAGES)} differ from the schema's stages {list(ORDER)}")
