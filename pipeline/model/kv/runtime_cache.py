"""The runtime-owned KV cache of an off-graph program, in Python: the reference for the C++ cache
(native/src/kernels/offgraph_cache.h), and the cache of eager off-graph modules and of the MLX interpreter.

One logical length shared by all layers; `plan` is pure, `commit` sets length = max(length, end). Flat
layers grow from `initial_capacity` by doubling up to `capacity` (cells never move); ring layers hold
window + max_write - 1 slots, slot = pos % ring (spec section 3).

Which cache an attention op reaches: a process-global binding. `with cache.bound():` makes it the active
one (the op raises a clear error if nothing is bound); the C++ kernel follows the same rule with its own
registry. The caller checks a step, runs it bound, and commits it once the whole forward succeeded:
pipeline/runtimes/base.py `step` does that for every holder of a runtime-owned cache.

Recurrent layers keep a fixed-size state here too (`set_states`, fp32 whatever the K/V dtype; the ops
llmpipe::state_delta / state_conv in pipeline/model/layers/recurrent.py): it holds the current length only, so a step
goes on at the length or starts over at 0, and a rewind goes to 0.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pipeline.model.kv.layout import LayerSpec, ring_runs
from pipeline.model.kv.quant import decode, encode, row_width

DEFAULT_INITIAL_CAPACITY = 512
# the C++ cache's names of the storage dtypes, in the [cache] report
DTYPE_LABELS = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.int8: "Int8",
                torch.uint8: "Int4"}


class OffgraphCacheError(RuntimeError):
    """A cache operation that cannot be done (overflow, unsafe rewind, nothing bound...)."""


@dataclass
class Plan:
    """Where one step of T tokens at position pos goes in one layer cache."""
    layer: int
    pos: int
    T: int
    base: int                                   # logical position of the first key read
    end: int                                    # pos + T: keys read are [base, end)
    write_runs: list[tuple[int, int]] = field(default_factory=list)  # (physical slot, count)
    read_runs: list[tuple[int, int]] = field(default_factory=list)   # oldest to newest

    @property
    def span(self) -> int:
        return self.end - self.base


class _Layer:
    def __init__(self, spec: LayerSpec, capacity: int, max_write: int, initial: int, dtype):
        self.spec = spec
        self.ring = min(spec.window + max_write - 1, capacity) if spec.window > 0 else None
        self.allocated = self.ring if self.ring is not None else min(initial, capacity)
        self.k = torch.zeros(spec.kv_heads, self.allocated, row_width(dtype, spec.head_dim), dtype=dtype)
        self.v = torch.zeros(spec.kv_heads, self.allocated, row_width(dtype, spec.v_dim), dtype=dtype)

    def ensure(self, end: int, capacity: int) -> None:
        """Flat pools double on demand (up to capacity); cell indices never move."""
        if self.ring is not None or end <= self.allocated:
            return
        new = self.allocated
        while new < end:
            new *= 2
        new = min(new, capacity)
        k = self.k.new_zeros(self.spec.kv_heads, new, self.k.shape[2])
        v = self.v.new_zeros(self.spec.kv_heads, new, self.v.shape[2])
        k[:, :self.allocated] = self.k
        v[:, :self.allocated] = self.v
        self.k, self.v, self.allocated = k, v, new


class OffgraphCache:
    """Runtime-owned KV cache for one sequence: a list of flat / ring layer caches."""

    def __init__(self, specs: Sequence[LayerSpec], capacity: int, max_write: int,
                 initial_capacity: int = DEFAULT_INITIAL_CAPACITY, dtype: torch.dtype = torch.float32):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_write < 1:
            raise ValueError(f"max_write (prefill chunk) must be >= 1, got {max_write}")
        if initial_capacity < 1:
            raise ValueError(f"initial capacity must be >= 1, got {initial_capacity}")
        if not specs:
            raise ValueError("an off-graph cache needs at least one layer")
        for i, s in enumerate(specs):
            if min(s.kv_heads, s.head_dim, s.v_dim) < 1 or s.window < 0:
                raise ValueError(f"cache {i}: bad geometry {s}")
        self.capacity = int(capacity)
        self.max_write = int(max_write)
        self.initial_capacity = min(int(initial_capacity), self.capacity)
        self.dtype = dtype
        self.specs = list(specs)
        self.length = 0
        self.layers = [_Layer(s, self.capacity, self.max_write, self.initial_capacity, dtype) for s in specs]
        self.shared_layers = 0  # attention layers that read another layer's cache (the report says so)
        self.states: list[dict[str, torch.Tensor]] = []  # per recurrent layer: "conv" and, for a DeltaNet, "delta"

    def set_states(self, dims: Sequence[int]) -> None:
        """The recurrent layers' state: five dims each (a DeltaNet's heads, key dim, value dim, or 0 0 0; the conv's
        rows and channels), as the program's get_state_shapes lists them."""
        states = []
        for i in range(0, len(dims) - 4, 5):
            heads, dk, dv, rows, channels = (int(d) for d in dims[i:i + 5])
            if rows < 1 or channels < 1 or min(heads, dk, dv) < 0 or (heads or dk or dv) and min(heads, dk, dv) < 1:
                raise ValueError(f"state {i // 5}: bad shape {list(dims[i:i + 5])}")
            state = {"conv": torch.zeros(rows, channels)}
            if heads:
                state["delta"] = torch.zeros(heads, dk, dv)
            states.append(state)
        self.states = states

    def store_as(self, dtype: torch.dtype) -> None:
        """Store K/V as `dtype` from now on (a runtime's choice per run, as --kv-storage-dtype): the layers
        re-allocated, the cache reset."""
        self.dtype = dtype
        self.layers = [_Layer(s, self.capacity, self.max_write, self.initial_capacity, dtype) for s in self.specs]
        self.reset()

    def __len__(self) -> int:
        return len(self.layers)

    # -- pure planning ------------------------------------------------------------------------
    def plan(self, layer: int, pos: int, T: int) -> Plan:
        if not 0 <= layer < len(self.layers):
            raise OffgraphCacheError(f"cache_id {layer} out of range: the cache has {len(self.layers)} layers")
        L = self.layers[layer]
        if T < 1:
            raise OffgraphCacheError(f"a step needs >= 1 token, got {T}")
        if pos < 0 or pos > self.length:
            raise OffgraphCacheError(
                f"write at position {pos} leaves a gap (cache length {self.length}); rewind first")
        end = pos + T
        if end > self.capacity:
            raise OffgraphCacheError(
                f"positions [{pos}, {end}) exceed the cache capacity {self.capacity}")
        if L.ring is None:
            return Plan(layer, pos, T, 0, end, ring_runs(pos, T, None), ring_runs(0, end, None))
        if T > self.max_write:
            raise OffgraphCacheError(
                f"a step of {T} tokens exceeds max_write {self.max_write} of ring cache {layer} "
                f"(window {L.spec.window}, {L.ring} slots)")
        base = max(0, pos - L.spec.window + 1)
        return Plan(layer, pos, T, base, end, ring_runs(pos, T, L.ring), ring_runs(base, end - base, L.ring))

    def plan_read(self, layer: int, pos: int, T: int) -> Plan:
        """A read-only step (a KV-shared layer attending over its source's cache): queries at [pos, pos+T),
        whose K/V the source layer wrote earlier in this forward (not yet committed, hence no gap check)."""
        if not 0 <= layer < len(self.layers):
            raise OffgraphCacheError(f"cache_id {layer} out of range: the cache has {len(self.layers)} layers")
        L = self.layers[layer]
        end = pos + T
        if T < 1 or pos < 0 or end > min(self.capacity, L.allocated if L.ring is None else self.capacity):
            raise OffgraphCacheError(f"a read of positions [{pos}, {end}) from cache {layer}: not written "
                                     f"(capacity {self.capacity}, {L.allocated} slots allocated)")
        if L.ring is None:
            return Plan(layer, pos, T, 0, end, [], ring_runs(0, end, None))
        if T > self.max_write:
            raise OffgraphCacheError(f"a read of {T} queries exceeds max_write {self.max_write} of ring cache {layer}")
        base = max(0, pos - L.spec.window + 1)
        return Plan(layer, pos, T, base, end, [], ring_runs(base, end - base, L.ring))

    def check_step(self, pos: int, T: int) -> None:
        """Raises unless a step of T tokens at pos fits every layer (before anything is written)."""
        if self.states and pos not in (0, self.length):
            raise OffgraphCacheError(f"a step at position {pos}: the recurrent state holds position {self.length} "
                                     "only (go on there, or start over at 0)")
        for layer in range(len(self.layers)):
            self.plan(layer, pos, T)

    def commit(self, pos: int, T: int) -> None:
        self.length = max(self.length, pos + T)

    # -- data ---------------------------------------------------------------------------------
    def write(self, plan: Plan, k: torch.Tensor, v: torch.Tensor) -> None:
        """k [Hkv,T,D], v [Hkv,T,Dv] (cast to the storage dtype, or quantized rows: kv/quant.py)."""
        L = self.layers[plan.layer]
        L.ensure(plan.end, self.capacity)
        off = 0
        for slot, n in plan.write_runs:
            L.k[:, slot:slot + n] = encode(k[:, off:off + n], self.dtype)
            L.v[:, slot:slot + n] = encode(v[:, off:off + n], self.dtype)
            off += n

    def gather(self, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of logical positions [base, end), oldest first: [Hkv,S,D], [Hkv,S,Dv]."""
        L = self.layers[plan.layer]
        ks = [L.k[:, s:s + n] for s, n in plan.read_runs]
        vs = [L.v[:, s:s + n] for s, n in plan.read_runs]
        return decode(torch.cat(ks, 1)), decode(torch.cat(vs, 1))

    # -- state --------------------------------------------------------------------------------
    def rewind_floor(self) -> int:
        """Smallest nonzero target a rewind may go to (rings must still hold its window)."""
        floor = 0
        for L in self.layers:
            if L.ring is None:
                continue
            oldest = max(0, self.length - L.ring)  # oldest position the ring still holds
            if oldest > 0:
                # target t needs positions [max(0, t - w + 1), t): t - w + 1 >= oldest
                floor = max(floor, oldest + L.spec.window - 1)
        return floor

    def can_rewind(self, target: int) -> tuple[bool, str]:
        if target < 0 or target > self.length:
            return False, f"cannot rewind to {target} (length {self.length})"
        if target in (0, self.length):
            return True, ""
        if self.states:
            return False, (f"cannot rewind to {target}: the recurrent state holds position {self.length} only "
                           "(0 to reset)")
        return self._rings_hold(target)

    def _rings_hold(self, target: int) -> tuple[bool, str]:
        floor = self.rewind_floor()
        if target < floor:
            return False, (f"cannot rewind to {target}: the ring caches no longer hold its window "
                           f"(lowest safe target {floor}, or 0 to reset)")
        return True, ""

    def rewind(self, target: int) -> None:
        ok, why = self.can_rewind(target)
        if not ok:
            raise OffgraphCacheError(why)
        self.length = target

    @property
    def recurrent(self) -> bool:
        return bool(self.states)

    def snapshot(self):
        """The length and a copy of the recurrent states: restore() goes back to them (speculation's rollback)."""
        return self.length, [{k: t.clone() for k, t in s.items()} for s in self.states]

    def restore(self, snap) -> None:
        length, states = snap
        ok, why = (length <= self.length, f"cannot restore a snapshot at {length} (length {self.length})")
        if ok and 0 < length:
            ok, why = self._rings_hold(length)
        if not ok:
            raise OffgraphCacheError(why)
        for now, then in zip(self.states, states):
            for k, t in now.items():
                t.copy_(then[k])
        self.length = length

    def reset(self) -> None:
        self.length = 0
        for state in self.states:
            for t in state.values():
                t.zero_()

    def bound(self):
        return bound(self)

    def describe(self) -> str:
        flat = sum(1 for L in self.layers if L.ring is None)
        rings = sorted({L.spec.window for L in self.layers if L.ring is not None})
        ring_txt = " + ".join(f"{sum(1 for L in self.layers if L.spec.window == w)} ring(window {w})"
                              for w in rings)
        dt = DTYPE_LABELS.get(self.dtype, str(self.dtype))
        kinds: dict[str, int] = {}
        for s in self.states:  # sorted by name, as the C++ report does
            name = f"matrix({'x'.join(map(str, s['delta'].shape))})" if "delta" in s else \
                f"conv({'x'.join(map(str, s['conv'].shape))})"
            kinds[name] = kinds.get(name, 0) + 1
        state_txt = "".join(f"{kinds[k]} {k} + " for k in sorted(kinds))
        return (f"[cache] off-graph seq | capacity={self.capacity} initial={self.initial_capacity} "
                f"kv_dtype={dt}\n{len(self.layers) + len(self.states)} layers: {state_txt}{flat} flat"
                + (f" + {ring_txt}" if rings else "")
                + (f", {self.shared_layers} shared" if self.shared_layers else ""))

    def nbytes(self) -> int:
        """Bytes of K/V and state storage allocated now."""
        return sum(L.k.numel() * L.k.element_size() + L.v.numel() * L.v.element_size() for L in self.layers) + \
            sum(t.numel() * t.element_size() for s in self.states for t in s.values())


# --------------------------------------------------------------------------------------------------
# the active-cache binding (process global; the op and the MLX interpreter find their cache here)
# --------------------------------------------------------------------------------------------------
_BOUND: Optional[OffgraphCache] = None


def bind(cache: Optional[OffgraphCache]) -> None:
    global _BOUND
    _BOUND = cache


def bound_cache() -> OffgraphCache:
    if _BOUND is None:
        raise OffgraphCacheError("no off-graph KV cache is bound (run the step inside `with cache.bound():`)")
    return _BOUND


@contextlib.contextmanager
def bound(cache: OffgraphCache):
    global _BOUND
    prev = _BOUND
    _BOUND = cache
    try:
        yield cache
    finally:
        _BOUND = prev


def run_step(cache, positions: torch.Tensor, forward):
    """One forward against a runtime-owned cache (this one or the C++ one: the same protocol). A step that
    starts before the cache's length rewinds it first (a rerun from 0 starts a new sequence); the step is
    checked before anything is written, runs with the cache bound, and is committed once it succeeded."""
    pos, T = int(positions[0]), int(positions.numel())
    if pos < cache.length:
        cache.rewind(pos)
    cache.check_step(pos, T)
    with cache.bound():
        out = forward()
    cache.commit(pos, T)
    return out
