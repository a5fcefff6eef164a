"""What runs a built program here, one module per runtime; the file name is the registry key.

    executorch   the ExecuTorch Python runtime (xnnpack, portable; off-graph programs get the C++ cache)
    mlx          our interpreter of MLX delegate payloads on mlx's CPU build (no MLX runtime on Linux)

`open_program(entry)` opens a lower-stage entry as a program callable like the eager wrapped module,
`(tokens Long[1, T], positions Long[T]) -> logits`, from what its lower.json records: the layout (one runner-layout
.pte, or the transformers exporter's prefill/decode pair), the runtime its backend needs, the kernel libraries
its ops need. The protocol and the one-program layout are in base.py, the pair in pair.py.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pipeline.registry import Registry
from pipeline.runtimes import executorch, mlx
from pipeline.runtimes.base import CachePolicy, RunnerProgram, Unsupported

RUNTIMES = Registry("runtime", {"executorch": executorch, "mlx": mlx})
LOWERED = "lower.json"

__all__ = ["RUNTIMES", "CachePolicy", "Unsupported", "open_program", "program_info"]


def program_info(entry: Path) -> dict:
    """The `program` record of a lower entry: layout, file(s), runtime, kernels."""
    return json.loads((Path(entry) / LOWERED).read_text())["program"]


def open_program(entry: Path, *, policy: Optional[CachePolicy] = None, runtime: Optional[str] = None):
    """The program of a lower entry, in its runtime (or `runtime`, e.g. the real MLX runtime on a Mac)."""
    info = program_info(entry)
    rt = RUNTIMES[runtime or info["runtime"]]
    if info["layout"] == "prefill_decode":
        from pipeline.runtimes.pair import open_pair
        return open_pair(entry, rt)
    return RunnerProgram(rt, Path(entry) / info["file"], policy, kernels=info.get("kernels", ()),
                         data=[Path(entry) / name for name in info.get("data", ())])
