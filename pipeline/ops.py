"""The operator libraries a program's host needs, and each in this Python process.

    python -m pipeline ops PTE            # the operators a .pte calls, and the library that provides each
    python -m pipeline ops --registered   # the operators this process has kernels for after load()
    python -m pipeline ops --isa          # the ISA path our kernels take here, and the paths this CPU has

    from pipeline import ops
    ops.load()      # after it, ExecuTorch's Python runtime and TextLLMRunner resolve every operator of ours

A program calls operators by name (`namespace::op.overload`); the runtime finds each in a registry that kernel
libraries fill when they load. Which library fills which namespace is a fact of the libraries, kept here once:
ExecuTorch's own (its core runtime's prim ops, the portable/optimized kernels, the quantized kernels), ExecuTorch's
LLM custom ops (extension/llm/custom_ops: in ExecuTorch's prebuilt Android and iOS runtimes, in the wheel only as a
Python-side library), and ours (native/'s libllmpipe_ops).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable


@dataclass(frozen=True)
class OpLibrary:
    link: str       # what a C++ host links (ExecuTorch's CMake targets, or ours)
    stock: bool     # in ExecuTorch's own runtime libraries, as the wheel ships them
    python: str     # how this process registers it (pipeline.ops.load does)
    ours: bool = False  # native/'s: an app needs our library for it (not ExecuTorch's, stock or not)
    twinned: bool = False  # our C++ runners run native/'s twins of it: the same function, other float bits


def _load_quantized() -> None:
    import executorch.kernels.quantized  # noqa: F401  (registers quantized_decomposed::*.out)


def _load_llama() -> None:
    # ExecuTorch's LLM ops: its AOT library registers their kernels in the Python runtime (it needs libtorch, so no
    # C++ runner of ours can link it: native/'s llmpipe_llama_ops twins them for those)
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401


def _load_ours() -> None:
    load_native_kernels()


_CORE = OpLibrary("executorch (the runtime: prim ops)", True, "executorch.runtime")
_KERNELS = OpLibrary("executorch_kernels_optimized (portable + optimized aten kernels)", True, "executorch.runtime")
LIBRARIES: dict[str, OpLibrary] = {
    "executorch_prim": _CORE,
    "aten": _KERNELS,
    "dim_order_ops": _KERNELS,
    "quantized_decomposed": OpLibrary("executorch_kernels_quantized", True, "import executorch.kernels.quantized"),
    # ExecuTorch's own, though not in its core runtime libraries: its prebuilt Android/iOS runtimes carry them
    "llama": OpLibrary("ExecuTorch's LLM custom ops (extension/llm/custom_ops; native/'s llmpipe_llama_ops for our "
                       "runners)", False, "from executorch.extension.llm.custom_ops import custom_ops", twinned=True),
    "llmpipe": OpLibrary("llmpipe_ops (native/: libllmpipe_ops.a / .so, CMake package llmpipe_ops)", False,
                         "pipeline.ops.load()", ours=True),
}
_LOADERS: dict[str, Callable[[], None]] = {"quantized_decomposed": _load_quantized, "llama": _load_llama,
                                           "llmpipe": _load_ours}
# a delegate's backend library, by the backend id a program names
DELEGATES = {"XnnpackBackend": "executorch_backend_xnnpack", "MLXBackend": "ExecuTorch's MLX delegate (Apple Silicon)"}

_loaded: set[str] = set()


def load(namespaces: Iterable[str] = ("quantized_decomposed", "llama", "llmpipe")) -> None:
    """Register the kernels of these namespaces' libraries in this process (idempotent): by default every library a
    program of ours can call beyond ExecuTorch's core runtime."""
    for ns in namespaces:
        if ns not in _loaded and ns in _LOADERS:
            _LOADERS[ns]()
            _loaded.add(ns)


def namespace(op: str) -> str:
    return op.split("::", 1)[0]


def library(op: str) -> OpLibrary:
    """The library that provides an operator (`ns::name[.overload]`); an unknown namespace raises with the known."""
    ns = namespace(op)
    if ns not in LIBRARIES:
        raise KeyError(f"operator {op!r}: no library known for namespace {ns!r} (known: {sorted(LIBRARIES)})")
    return LIBRARIES[ns]


def program_operators(plans) -> tuple[list[str], list[str]]:
    """(operators `ns::name.overload`, delegate backend ids) of a program's execution plans (an ExecuTorch
    Program's `execution_plan`), over every method."""
    ops, delegates = set(), set()
    for plan in plans:
        ops |= {f"{o.name}.{o.overload}" if o.overload else o.name for o in plan.operators}
        delegates |= {d.id for d in plan.delegates}
    return sorted(ops), sorted(delegates)


def read_program(pte: Path):
    """The execution plans of a .pte file (ExecuTorch's own deserializer: a third of a second for 100 MB)."""
    from executorch.exir._serialize._program import deserialize_pte_binary
    p = deserialize_pte_binary(Path(pte).read_bytes())
    return getattr(p, "program", p).execution_plan


def requirements(operators: Iterable[str], delegates: Iterable[str]) -> dict:
    """What a host needs to run a program: the operators beyond ExecuTorch's stock libraries, each with the library
    that provides it, every library to link (delegates' backends included), and whether any of them is ours
    (needs_ours false: ExecuTorch's own operators alone, its LLM custom ops included)."""
    operators = list(operators)
    beyond = {op: library(op).link for op in operators if not library(op).stock}
    links = sorted({library(op).link for op in operators} | {DELEGATES.get(d, d) for d in delegates})
    return {"beyond_stock": dict(sorted(beyond.items())), "libraries": links, "stock_only": not beyond,
            "needs_ours": any(library(op).ours for op in operators),
            "namespaces": sorted({namespace(op) for op in operators})}


def describe(req: dict) -> str:
    """One line on what a program needs (the build summary's and `python -m pipeline ops PTE`'s)."""
    beyond = req["beyond_stock"]
    if not beyond:
        return "ExecuTorch's stock libraries alone"
    if not req.get("needs_ours", True):
        return f"ExecuTorch's own operators only (its LLM custom ops: {', '.join(beyond)})"
    return "beyond ExecuTorch's stock libraries " + ", ".join(f"{op} ({lib.split(' ')[0]})" for op, lib in beyond.items())


# our kernels' ISA paths by architecture (native/src/kernels/isa.h: LLMPIPE_ISA's values), slowest first
ISA_PATHS = {"x86_64": ("scalar", "avx2", "avx512"), "aarch64": ("scalar", "neon", "dotprod")}


def isa_problem() -> str | None:
    """Why LLMPIPE_ISA names no path of this machine's architecture (None: unset or one of them); whether this CPU
    takes it, the kernels say when they load."""
    import os
    import platform
    want, paths = os.environ.get("LLMPIPE_ISA", ""), ISA_PATHS.get(platform.machine(), ("scalar",))
    return None if not want or want in paths else f"not a path of {platform.machine()}: {', '.join(paths)}"


def isa_paths() -> list[str]:
    """The paths of our kernels that this build has and this CPU takes."""
    import platform
    lib = _kernels_library()
    return [p for p in ISA_PATHS.get(platform.machine(), ("scalar",)) if lib.llmpipe_isa_supported(p.encode())]


def isa() -> str:
    """The path our kernels take in this process (LLMPIPE_ISA, or the best this CPU has)."""
    return _kernels_library().llmpipe_isa_describe().decode()


def _kernels_library():
    import ctypes

    lib = load_native_kernels()
    lib.llmpipe_isa_supported.restype, lib.llmpipe_isa_supported.argtypes = ctypes.c_int, [ctypes.c_char_p]
    return lib


def registered() -> list[str]:
    """The operators this process's ExecuTorch runtime has kernels for."""
    from executorch.extension.pybindings import portable_lib
    return sorted(portable_lib._get_operator_names())


# ---- our kernel library in this process (ctypes): its operators registered, its C API declared ----

_NATIVE_LIB = None


def load_native_kernels(path=None):
    """Loads libllmpipe_ops.so with RTLD_GLOBAL (registers every llmpipe:: kernel in the Python runtime's
    libexecutorch) and returns the ctypes handle. Idempotent. A bad LLMPIPE_ISA raises, naming the paths."""
    global _NATIVE_LIB
    if _NATIVE_LIB is not None:
        return _NATIVE_LIB
    import ctypes
    if path is None:
        from pipeline.native import kernels_library_path
        path = kernels_library_path()
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    vp, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    p64 = ctypes.POINTER(ctypes.c_int64)
    lib.llmpipe_cache_create.restype = vp
    lib.llmpipe_cache_create.argtypes = [c_int, p64, p64, p64, p64, i64, i64, i64, c_int]
    for name, res, args in [("llmpipe_cache_destroy", None, [vp]), ("llmpipe_cache_bind", None, [vp]),
                            ("llmpipe_cache_check_step", c_int, [vp, i64, i64]),
                            ("llmpipe_cache_commit", None, [vp, i64, i64]),
                            ("llmpipe_cache_rewind", c_int, [vp, i64]),
                            ("llmpipe_cache_snapshot", vp, [vp, vp]), ("llmpipe_cache_restore", c_int, [vp, vp]),
                            ("llmpipe_snapshot_free", None, [vp]),
                            ("llmpipe_cache_reset", None, [vp]), ("llmpipe_cache_length", i64, [vp]),
                            ("llmpipe_cache_allocated", i64, [vp, c_int]),
                            ("llmpipe_cache_describe", ctypes.c_char_p, [vp]),
                            ("llmpipe_cache_set_shared", None, [vp, i64]), ("llmpipe_cache_bytes", i64, [vp]),
                            ("llmpipe_cache_set_states", c_int, [vp, c_int, p64]),
                            ("llmpipe_back_with_huge_pages", i64, [i64]),
                            ("llmpipe_last_error", ctypes.c_char_p, []), ("llmpipe_isa", ctypes.c_char_p, []),
                            ("llmpipe_isa_problem", ctypes.c_char_p, []),
                            ("llmpipe_isa_describe", ctypes.c_char_p, [])]:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    problem = lib.llmpipe_isa_problem().decode()
    if problem:
        raise RuntimeError(f"native kernels: {problem}")
    _NATIVE_LIB = lib
    return lib


def back_with_huge_pages(min_bytes: int = 4 << 20) -> int:
    """The C++ runners' --huge-pages in this process (native/src/platform/huge_pages.h): its large anonymous
    mappings (XNNPACK's packed weights, the KV cache) collapsed onto 2 MiB pages. Returns the bytes now on them."""
    return int(load_native_kernels().llmpipe_back_with_huge_pages(int(min_bytes)))
