"""The C++ off-graph cache and kernels (native/'s libllmpipe_ops.so) in this process, through ctypes:
the cache the ExecuTorch Python runtime's off-graph programs reach, the same one the C++ runners use."""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from pipeline.abi import SCALAR_TYPE_CODES
from pipeline.ops import load_native_kernels
from pipeline.model.kv.layout import LayerSpec
from pipeline.model.kv.runtime_cache import DEFAULT_INITIAL_CAPACITY, OffgraphCacheError

class NativeOffgraphCache:
    """The C++ OffgraphKvCache (native/src/kernels/offgraph_cache.h), driven from Python."""

    def __init__(self, specs: Sequence[LayerSpec], capacity: int, max_write: int,
                 initial_capacity: int = DEFAULT_INITIAL_CAPACITY, dtype: torch.dtype = torch.float32):
        import ctypes
        self._lib = lib = load_native_kernels()
        n = len(specs)
        arr = ctypes.c_int64 * max(n, 1)
        h = lib.llmpipe_cache_create(n, arr(*[s.kv_heads for s in specs]), arr(*[s.head_dim for s in specs]),
                                     arr(*[s.v_dim for s in specs]), arr(*[s.window for s in specs]),
                                     int(capacity), int(max_write), int(initial_capacity), SCALAR_TYPE_CODES[dtype])
        if not h:
            raise ValueError(self._error())
        self._h = h
        self._shared = 0
        self._recurrent = False
        self._snap = None  # the one snapshot speculation keeps (its storage reused step after step)

    def _error(self) -> str:
        return self._lib.llmpipe_last_error().decode()

    def __del__(self):
        if getattr(self, "_snap", None):
            self._lib.llmpipe_snapshot_free(self._snap)
            self._snap = None
        h = getattr(self, "_h", None)
        if h:
            self._lib.llmpipe_cache_destroy(h)
            self._h = None

    @property
    def length(self) -> int:
        return self._lib.llmpipe_cache_length(self._h)

    def allocated(self, layer: int) -> int:
        return self._lib.llmpipe_cache_allocated(self._h, layer)

    def check_step(self, pos: int, T: int) -> None:
        if self._lib.llmpipe_cache_check_step(self._h, pos, T) != 0:
            raise OffgraphCacheError(self._error())

    @contextlib.contextmanager
    def bound(self):
        """The kernel reaches this cache while the step runs (one binding per process, as in the runners)."""
        self._lib.llmpipe_cache_bind(self._h)
        try:
            yield self
        finally:
            self._lib.llmpipe_cache_bind(None)

    def commit(self, pos: int, T: int) -> None:
        self._lib.llmpipe_cache_commit(self._h, pos, T)

    def rewind(self, target: int) -> None:
        if self._lib.llmpipe_cache_rewind(self._h, target) != 0:
            raise OffgraphCacheError(self._error())

    def snapshot(self):
        """The length and the recurrent states now; restore() goes back to them. One snapshot at a time: taking
        another overwrites it."""
        self._snap = self._lib.llmpipe_cache_snapshot(self._h, self._snap)
        return self._snap

    def restore(self, snap) -> None:
        if self._lib.llmpipe_cache_restore(self._h, snap) != 0:
            raise OffgraphCacheError(self._error())

    @property
    def recurrent(self) -> bool:
        return self._recurrent

    def reset(self) -> None:
        self._lib.llmpipe_cache_reset(self._h)

    @property
    def shared_layers(self) -> int:
        return self._shared

    @shared_layers.setter
    def shared_layers(self, n: int) -> None:
        self._shared = int(n)
        self._lib.llmpipe_cache_set_shared(self._h, self._shared)

    def set_states(self, dims: Sequence[int]) -> None:
        """The recurrent layers' state: five dims each, as the program's get_state_shapes lists them."""
        import ctypes
        arr = (ctypes.c_int64 * max(len(dims), 1))(*dims)
        if self._lib.llmpipe_cache_set_states(self._h, len(dims) // 5, arr) != 0:
            raise ValueError(self._error())
        self._recurrent = len(dims) >= 5

    def nbytes(self) -> int:
        """Bytes of K/V and state storage allocated now."""
        return self._lib.llmpipe_cache_bytes(self._h)

    def describe(self) -> str:
        return self._lib.llmpipe_cache_describe(self._h).decode()
