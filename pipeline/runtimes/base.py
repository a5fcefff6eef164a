"""What every runtime gives a built program: the runner layout's call, `(tokens Long[1, T], positions Long[T])
-> logits`, the same interface as the eager wrapped module, so verify's checks run on either unchanged.

A runtime module (pipeline/runtimes/<name>.py, the key of RUNTIMES) provides:
    load(path, kernels=()) -> a loaded program: method_names, constant(name), execute(inputs, method="forward"),
                              input_meta(method="forward") -> [(sizes, ScalarType code)], reset()
    Cache                  -- the runtime-owned KV cache its off-graph programs reach (a step protocol:
                              length, check_step, bound(), commit, rewind, reset, describe)
    describe() -> str      -- what ran the program, for the verify report
Program layouts over a loaded program: RunnerProgram here (one .pte), pair.py (the transformers exporter's two).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from pipeline import abi
from pipeline.model.kv.layout import LayerSpec
from pipeline.model.kv.runtime_cache import DEFAULT_INITIAL_CAPACITY, run_step


class Unsupported(RuntimeError):
    """A program this runtime cannot run (it is refused whole, never half-run); `op` names what."""

    def __init__(self, op: str, why: str = ""):
        super().__init__(f"unsupported: {op}" + (f" ({why})" if why else ""))
        self.op = op


@dataclass
class CachePolicy:
    """How a runtime-owned cache is sized for a run (the C++ runners' --kv-* flags, verify.runtime)."""
    capacity: Optional[int] = None                    # positions; None = the program's max context
    initial_capacity: int = DEFAULT_INITIAL_CAPACITY  # flat pools start here and double up to the capacity
    windows: Optional[Sequence[int]] = None           # pattern repeated over the caches, 0 = flat; None = the program's
    kv_dtype: Optional[torch.dtype] = None            # None = the program's activation dtype


def runtime_cache_plan(constant, names, windows: Optional[Sequence[int]] = None,
                       kv_dtype: Optional[torch.dtype] = None) -> tuple[list[LayerSpec], int, int, torch.dtype]:
    """The runtime cache an off-graph program asks for, read from its constant methods (`constant(name)`;
    `names` = the program's methods): (layer specs, context, max write, storage dtype). `windows` overrides
    the program's windows (a pattern repeated over the caches); the largest write is the exported chunk, whatever
    the windows (a ring holds window + chunk - 1 slots), as in the C++ runners."""
    n = abi.ints(constant("get_n_caches"))[0]
    heads = abi.ints(constant("get_kv_heads"))
    dims = abi.ints(constant("get_head_dims"))
    vdims = abi.ints(constant("get_v_head_dims")) if "get_v_head_dims" in names else dims
    wins = abi.ints(constant("get_windows"))
    if windows:
        wins = [int(windows[i % len(windows)]) for i in range(n)]
    chunk = abi.ints(constant(abi.MAX_SEQ_LEN))[0]
    ctx = abi.ints(constant(abi.MAX_CONTEXT_LEN))[0]
    dtype = kv_dtype or abi.SCALAR_TYPES[abi.ints(constant(abi.ACTIVATION_DTYPE))[0]]
    specs = [LayerSpec(heads[i], dims[i], vdims[i], wins[i]) for i in range(n)]
    return specs, ctx, chunk, dtype


class RunnerProgram:
    """A runner-layout program (one .pte) in a runtime. An off-graph program (it publishes get_n_caches) gets
    the runtime's own cache, built from its constant methods under `policy`; each call is a step against it.
    `chunk` is the most tokens one call takes (the exported prefill chunk)."""

    def __init__(self, runtime, path, policy: Optional[CachePolicy] = None, kernels: Sequence[str] = (),
                 data: Sequence = ()):
        # data: the program's data files (an adapter kept apart: the base's foundation.ptd)
        self.program = runtime.load(path, kernels=kernels, **({"data": data} if data else {}))
        self.cache = None
        names = self.program.method_names
        self.chunk = abi.ints(self.program.constant(abi.MAX_SEQ_LEN))[0] if abi.MAX_SEQ_LEN in names else None
        # logits mode `selected`: forward takes rows Long[R]; a single-session call asks for the last row
        mode = abi.ints(self.program.constant(abi.LOGITS_MODE))[0] if abi.LOGITS_MODE in names else None
        self.selected = mode == abi.LOGITS_MODE_CODES["selected"]
        # every row's logits in one call (speculation's verify step): a `full` or `selected` program, or a `tail`
        # one's last get_tail_rows rows
        self.tail_rows = abi.ints(self.program.constant(abi.TAIL_ROWS))[0] if abi.TAIL_ROWS in names else None
        self.rows_logits = mode in (abi.LOGITS_MODE_CODES["full"], abi.LOGITS_MODE_CODES["selected"],
                                    abi.LOGITS_MODE_CODES["tail"])
        self.recurrent = "get_state_shapes" in names  # recurrent layers: a state that cannot be rewound
        if "get_n_caches" in names:
            policy = policy or CachePolicy()
            specs, ctx, self.chunk, dtype = runtime_cache_plan(self.program.constant, names, policy.windows,
                                                               policy.kv_dtype)
            self.cache = runtime.Cache(specs, policy.capacity or ctx, self.chunk, policy.initial_capacity, dtype)
            if "get_n_shared_layers" in names:  # KV-shared layers read their source's cache: no cache of their own
                self.cache.shared_layers = abi.ints(self.program.constant("get_n_shared_layers"))[0]
            if "get_state_shapes" in names:  # recurrent layers: their state is the runtime's too
                self.cache.set_states(abi.ints(self.program.constant("get_state_shapes")))

    def constant(self, name: str):
        return self.program.constant(name)

    @property
    def verify_rows(self) -> int:
        """The most rows whose logits one call returns (a verify step's width): the chunk, or a `tail` program's
        get_tail_rows."""
        return min(self.chunk, self.tail_rows) if self.tail_rows else self.chunk

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, all_rows: bool = False) -> torch.Tensor:
        """Logits [1, R, V]: the last row, or with `all_rows` every row (a `full` or `selected` program; a `tail`
        one's up to get_tail_rows)."""
        def forward():
            rows = torch.arange(tokens.shape[1]) if all_rows else torch.tensor([tokens.shape[1] - 1])
            extra = [rows.to(torch.long)] if self.selected else []
            out = self.program.execute([tokens, positions, *extra])[0]
            # a `tail` program returns its last rows: the last one alone where one was asked
            return out[:, -1:] if self.tail_rows and not all_rows else out
        return forward() if self.cache is None else run_step(self.cache, positions, forward)

    def reset(self) -> None:
        self.program.reset()
        if self.cache is not None:
            self.cache.reset()

    @property
    def can_snapshot(self) -> bool:
        """Whether snapshot() holds every state a rewind cannot give back: a recurrent state is the runtime cache's
        (off-graph on XNNPACK) or in program buffers its runtime can copy (the MLX interpreter's)."""
        return not self.recurrent or hasattr(self.program, "snapshot") or \
            (self.cache is not None and self.cache.recurrent)

    def snapshot(self):
        """What restore() needs to go back to this point; None when a rewind of the cache will do."""
        if not self.recurrent:
            return None
        return (self.cache.snapshot() if self.cache is not None and self.cache.recurrent else None,
                self.program.snapshot() if hasattr(self.program, "snapshot") else None)

    def restore(self, snap) -> None:
        cache, program = snap
        if cache is not None:
            self.cache.restore(cache)
        if program is not None:
            self.program.restore(program)


@torch.no_grad()
def run_sequence(module, ids: list[int], chunk: int, start: int = 0) -> torch.Tensor:
    """Feed ids through a runner-layout callable (eager or built) in chunks from `start`; returns the last
    position's logits [V]."""
    logits = None
    for s in range(0, len(ids), chunk):
        piece = ids[s:s + chunk]
        tokens = torch.tensor([piece], dtype=torch.long)
        positions = torch.arange(start + s, start + s + len(piece), dtype=torch.long)
        logits = module(tokens, positions)
    return logits[0, -1].float()


@torch.no_grad()
def run_rows(module, ids: list[int], chunk: int, start: int = 0) -> list[torch.Tensor]:
    """The logits after each of ids, fed from `start`. An eager wrapped module (it has `logits_mode`) returns every
    row of a chunk in one call; a built program returns only its exported rows, so it takes one token per call."""
    mode = getattr(module, "logits_mode", None) if isinstance(module, torch.nn.Module) else None
    if mode is None:
        return [run_sequence(module, [t], 1, start=start + i) for i, t in enumerate(ids)]
    module.logits_mode = "full"
    try:
        rows = []
        for s in range(0, len(ids), chunk):
            piece = ids[s:s + chunk]
            positions = torch.arange(start + s, start + s + len(piece), dtype=torch.long)
            rows.extend(module(torch.tensor([piece], dtype=torch.long), positions)[0].float().unbind(0))
        return rows
    finally:
        module.logits_mode = mode
