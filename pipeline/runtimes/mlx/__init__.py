"""Run an MLX-delegated .pte without a Mac: read the delegate's payload and execute it with `mlx` on the CPU.

ExecuTorch's MLX backend (C++, Apple only) interprets a FlatBuffer program: tensor slots (constants, inputs,
outputs, mutable buffers, temporaries), int/float value slots, and chains of instructions. This runtime reads
the same payload (payload.py) and gives every instruction the meaning of the backend's handler (ops.py);
program.py runs a whole .pte. kvcache::update_and_attend reaches the bound runtime-owned cache, the Python
OffgraphCache with the policy our runners use.

    python -m pipeline mlx_interpreter model.pte      # list the instructions and whether each is covered
"""
from __future__ import annotations

import importlib.metadata as md
from typing import Sequence

from pipeline.model.kv.runtime_cache import OffgraphCache
from pipeline.runtimes.mlx.program import MLXProgram

Cache = OffgraphCache


def load(path, kernels: Sequence[str] = ()) -> MLXProgram:
    return MLXProgram(path)


def describe() -> str:
    return f"pipeline.runtimes.mlx (mlx {md.version('mlx')}, CPU)"
