"""The ExecuTorch Python runtime (pybindings): the runtime of every xnnpack and portable program here."""
from __future__ import annotations

import importlib.metadata as md
from pathlib import Path
from typing import Sequence

from pipeline.abi import DATA_FILES
from pipeline.ops import load_native_kernels
from pipeline.runtimes.native_cache import NativeOffgraphCache

Cache = NativeOffgraphCache  # off-graph programs reach the C++ cache, as in the C++ runners

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


class ExecutorchProgram:
    """One .pte loaded in the Python runtime."""

    def __init__(self, path: Path, kernels: Sequence[str] = (), data: Sequence[Path] = ()):
        from executorch.runtime import Runtime
        load_kernels()
        if "llmpipe" in kernels:  # our attention ops' .out kernels live in native/'s library
            load_native_kernels()
        if "llama" in kernels:  # ExecuTorch's LLM ops (cache.mode=stock): its own AOT library registers them
            from pipeline import ops
            ops.load(["llama"])
        self.program = Runtime.get().load_program(Path(path))
        self.method_names = set(self.program.method_names)
        if DATA_FILES in self.method_names:  # an adapter program: its base's weights are in a data file
            data = data or [Path(path).parent / name for name in self.program.load_method(DATA_FILES).execute([])[0]
                            .split(",")]
            if len(data) != 1 or not Path(data[0]).is_file():
                raise FileNotFoundError(f"{path} reads its weights from {[str(d) for d in data]}: the Python runtime "
                                        "loads one data file with a program, and it must exist")
            self.program = Runtime.get().load_program(Path(path), data_path=str(data[0]))
        self._methods: dict = {}
        if "forward" in self.method_names:
            self._method("forward")  # a program this runtime cannot run fails here, not at its first call

    def _method(self, name: str):
        if name not in self._methods:
            self._methods[name] = self.program.load_method(name)
        return self._methods[name]

    def constant(self, name: str):
        out = self._method(name).execute([])
        return out[0] if len(out) == 1 else list(out)

    def execute(self, inputs: list, method: str = "forward") -> list:
        return list(self._method(method).execute(inputs))

    def input_meta(self, method: str = "forward") -> list[tuple[tuple, int]]:
        meta = self._method(method).metadata
        return [(tuple(meta.input_tensor_meta(j).sizes()), int(meta.input_tensor_meta(j).dtype()))
                for j in range(meta.num_inputs())]

    def reset(self) -> None:
        pass  # a program's mutable buffers are rewritten from the step's position (a rerun from 0 restarts)


def load(path, kernels: Sequence[str] = (), data: Sequence[Path] = ()) -> ExecutorchProgram:
    return ExecutorchProgram(path, kernels, data)


def describe() -> str:
    return f"ExecuTorch Python runtime (executorch {md.version('executorch')})"
