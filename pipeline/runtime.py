"""The ExecuTorch Python runtime, behind the same small interface as an eager wrapped module."""
from __future__ import annotations

from pathlib import Path

import torch

_kernels_loaded = False


def load_kernels() -> None:
    """The Python runtime has no quantized kernels registered until these modules are imported."""
    global _kernels_loaded
    if _kernels_loaded:
        return
    import executorch.kernels.quantized  # noqa: F401
    # not executorch.extension.llm.custom_ops (llama:: ops): no recipe uses them, and its import runs a bare
    # `except:` that can swallow a Ctrl-C (bench/et_ops.py imports it for its yardstick)
    _kernels_loaded = True


class PteModule:
    """Callable like the wrapped eager module: (tokens [1,T], positions [T]) -> logits."""

    def __init__(self, path: Path):
        from executorch.runtime import Runtime
        load_kernels()
        self.program = Runtime.get().load_program(Path(path))
        self.forward = self.program.load_method("forward")

    def constant(self, name: str):
        out = self.program.load_method(name).execute([])
        return out[0] if len(out) == 1 else list(out)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.forward.execute([tokens, positions])[0]
