"""The `offgraph` KV-cache mode: attention layers call one op, the cache lives in the runtime.

    llmpipe::update_and_attend(q, k, v, position, cache_id, scale, out_dtype) -> out

- q [B,Hq,T,D], k [B,Hkv,T,D], v [B,Hkv,T,Dv] (q and k already RoPE-rotated, Hq % Hkv == 0),
  position [T] (or [T,1]) int, contiguous positions pos..pos+T-1; returns [B,Hq,T,Dv] in out_dtype.
- To the tracer the op is functional (no mutated args; the fake impl returns an empty tensor of the
  output shape), so the exported graph has no buffers and no mutations: one op per attention layer.
  `llmpipe::update_and_attend.out` is the out variant that `to_executorch` emits.
- Semantics: write this step's K/V at logical positions [pos, pos+T) of cache `cache_id`, then attend
  over the cached history (fp32, cast to out_dtype) with the causal mask, banded on sliding layers.

Which cache: a process-global binding. `bind(cache)` (or `with bound(cache):`) makes an OffgraphCache
the active one; `cache_id` is the index of a layer cache in it. The op raises a clear error if nothing
is bound. The C++ kernel (native/src/offgraph_*.{h,cpp}) follows the same rule with its own registry.
The caller (wrapper, runner) commits the step once the whole forward succeeded.

Runtime cache (OffgraphCache, spec section 3): one logical length shared by all layers; `plan` is
pure, `commit` sets length = max(length, end). Flat layers grow from `initial_capacity` by doubling
up to `capacity` (cells never move); ring layers hold window + max_write - 1 slots, slot = pos % ring.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from pipeline.attention import (HookedAttentionLM, attend_gathered, attention_layers, check_step, define_op,
                                ring_runs, step_args)

NAMESPACE = "llmpipe"
OP_NAME = "update_and_attend"
QUALNAME = f"{NAMESPACE}::{OP_NAME}"
ATTN_IMPL = "llmpipe_offgraph"  # the HF attention-implementation name the wrapper switches to
DEFAULT_INITIAL_CAPACITY = 512


class OffgraphCacheError(RuntimeError):
    """A cache operation that cannot be done (overflow, unsafe rewind, nothing bound...)."""


# --------------------------------------------------------------------------------------------------
# the runtime cache (Python reference; native/src/offgraph_cache.h is the C++ twin)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerSpec:
    kv_heads: int
    head_dim: int
    v_dim: int
    window: int = 0  # 0 = flat (full attention)


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
        self.k = torch.zeros(spec.kv_heads, self.allocated, spec.head_dim, dtype=dtype)
        self.v = torch.zeros(spec.kv_heads, self.allocated, spec.v_dim, dtype=dtype)

    def ensure(self, end: int, capacity: int) -> None:
        """Flat pools double on demand (up to capacity); cell indices never move."""
        if self.ring is not None or end <= self.allocated:
            return
        new = self.allocated
        while new < end:
            new *= 2
        new = min(new, capacity)
        k = self.k.new_zeros(self.spec.kv_heads, new, self.spec.head_dim)
        v = self.v.new_zeros(self.spec.kv_heads, new, self.spec.v_dim)
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

    def commit(self, pos: int, T: int) -> None:
        self.length = max(self.length, pos + T)

    # -- data ---------------------------------------------------------------------------------
    def write(self, plan: Plan, k: torch.Tensor, v: torch.Tensor) -> None:
        """k [Hkv,T,D], v [Hkv,T,Dv] (cast to the storage dtype)."""
        L = self.layers[plan.layer]
        L.ensure(plan.end, self.capacity)
        off = 0
        for slot, n in plan.write_runs:
            L.k[:, slot:slot + n] = k[:, off:off + n].to(self.dtype)
            L.v[:, slot:slot + n] = v[:, off:off + n].to(self.dtype)
            off += n

    def gather(self, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of logical positions [base, end), oldest first: [Hkv,S,D], [Hkv,S,Dv]."""
        L = self.layers[plan.layer]
        ks = [L.k[:, s:s + n] for s, n in plan.read_runs]
        vs = [L.v[:, s:s + n] for s, n in plan.read_runs]
        return torch.cat(ks, 1), torch.cat(vs, 1)

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
        if target == 0:
            return True, ""
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

    def reset(self) -> None:
        self.length = 0

    def describe(self) -> str:
        flat = sum(1 for L in self.layers if L.ring is None)
        rings = sorted({L.spec.window for L in self.layers if L.ring is not None})
        ring_txt = " + ".join(f"{sum(1 for L in self.layers if L.spec.window == w)} ring(window {w})"
                              for w in rings)
        dt = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16"}.get(self.dtype, str(self.dtype))
        return (f"[cache] off-graph seq | capacity={self.capacity} initial={self.initial_capacity} "
                f"kv_dtype={dt}\n{len(self.layers)} layers: {flat} flat" + (f" + {ring_txt}" if rings else ""))


# --------------------------------------------------------------------------------------------------
# the active-cache binding (process global; the op finds its cache here)
# --------------------------------------------------------------------------------------------------
_BOUND: Optional[OffgraphCache] = None


def bind(cache: Optional[OffgraphCache]) -> None:
    global _BOUND
    _BOUND = cache


def bound_cache() -> Optional[OffgraphCache]:
    return _BOUND


@contextlib.contextmanager
def bound(cache: OffgraphCache):
    prev = _BOUND
    bind(cache)
    try:
        yield cache
    finally:
        bind(prev)


# --------------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------------
def attend(cache: OffgraphCache, q, k, v, position, cache_id: int, scale: float, out_dtype) -> torch.Tensor:
    """Reference semantics: write, then attend over the cached history (fp32)."""
    pos, T = check_step(QUALNAME, q, k, v, position)
    spec = cache.specs[cache_id] if 0 <= cache_id < len(cache.specs) else None
    if spec is not None and (spec.kv_heads != k.shape[1] or spec.head_dim != k.shape[3]
                             or spec.v_dim != v.shape[3]):
        raise OffgraphCacheError(f"cache {cache_id} holds {spec} but the step has k {tuple(k.shape)}, "
                                 f"v {tuple(v.shape)}")
    plan = cache.plan(cache_id, pos, T)
    cache.write(plan, k[0], v[0])
    K, V = cache.gather(plan)                                    # [Hkv,S,D], [Hkv,S,Dv]
    return attend_gathered(q, K, V, pos, plan.base, spec.window, scale, out_dtype)


def _define() -> None:
    def eager(q, k, v, position, cache_id, scale, out_dtype):
        cache = _BOUND
        if cache is None:
            raise OffgraphCacheError(
                f"{QUALNAME}: no off-graph KV cache is bound (call pipeline.offgraph.bind(cache) "
                "before running the model)")
        return attend(cache, q, k, v, position, int(cache_id), float(scale), out_dtype)

    def fake(q, k, v, position, cache_id, scale, out_dtype):
        return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), dtype=out_dtype)

    globals()["_LIB"] = define_op(
        NAMESPACE, OP_NAME, "Tensor q, Tensor k, Tensor v, Tensor position, int cache_id, float scale, "
        "ScalarType out_dtype", "a", eager, fake)


if not hasattr(torch.ops, NAMESPACE) or not hasattr(getattr(torch.ops, NAMESPACE), OP_NAME):
    _define()

update_and_attend = torch.ops.llmpipe.update_and_attend


# --------------------------------------------------------------------------------------------------
# cache geometry from an HF config
# --------------------------------------------------------------------------------------------------
def layer_types(cfg) -> list[str]:
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "model_type", "") not in ("llama",):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


@dataclass(frozen=True)
class CacheLayout:
    """layer -> cache index, and one LayerSpec per cache."""
    layer_cache: list[int]
    specs: list[LayerSpec]

    @property
    def n_caches(self) -> int:
        return len(self.specs)


def cache_layout(cfg, windows: Optional[Sequence[int]] = None) -> CacheLayout:
    """One cache per attention layer; `windows` (a pattern repeated over the caches, 0 = flat) overrides
    the model's policy (a runner-side choice: never heads or dims)."""
    if getattr(cfg, "num_kv_shared_layers", 0):
        raise NotImplementedError("offgraph: KV-shared layers (num_kv_shared_layers) are not supported yet")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise NotImplementedError("offgraph: attention logit softcapping is not supported")
    n = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads
    types = layer_types(cfg)
    window = getattr(cfg, "sliding_window", None) or 0
    specs = []
    for i in range(n):
        w = window if types[i] == "sliding_attention" else 0
        if windows:
            w = int(windows[i % len(windows)])
        specs.append(LayerSpec(kv_heads, head_dim, head_dim, w))
    return CacheLayout(list(range(n)), specs)


def constant_methods(cfg) -> dict:
    """The cache-geometry constant methods the .pte publishes (beside the pipeline's others)."""
    lay = cache_layout(cfg)
    methods = {
        "get_n_caches": lay.n_caches,
        "get_kv_heads": torch.tensor([s.kv_heads for s in lay.specs], dtype=torch.long),
        "get_head_dims": torch.tensor([s.head_dim for s in lay.specs], dtype=torch.long),
        "get_windows": torch.tensor([s.window for s in lay.specs], dtype=torch.long),
    }
    if any(s.v_dim != s.head_dim for s in lay.specs):
        methods["get_v_head_dims"] = torch.tensor([s.v_dim for s in lay.specs], dtype=torch.long)
    return methods


# --------------------------------------------------------------------------------------------------
# the HF attention hook and the runner-layout wrapper
# --------------------------------------------------------------------------------------------------
def _offgraph_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        sliding_window=None, **kwargs):
    """HF attention-interface function: q/k arrive RoPE-rotated, [B,H,T,D]; returns ([B,T,H,Dv], None)."""
    positions, scaling = step_args("offgraph", query, scaling, kwargs)
    cache_id = getattr(module, "_offgraph_cache_id", None)
    if cache_id is None:
        raise RuntimeError(f"offgraph attention: layer {getattr(module, 'layer_idx', '?')} has no cache id")
    out = torch.ops.llmpipe.update_and_attend(query, key, value, positions.reshape(-1), cache_id,
                                              scaling, query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


class OffgraphLM(HookedAttentionLM):
    """Runner layout over an HF causal LM whose attention calls llmpipe::update_and_attend.

    forward(tokens Long[1,T], positions Long[T]) -> logits. Exported, the graph holds no cache. Run
    eagerly, the wrapper owns an OffgraphCache (`self.cache`), binds it for the call, rewinds it when
    a step starts before its length (a rerun from 0 starts a new sequence) and commits after.
    """

    ATTN_IMPL = ATTN_IMPL
    attention_fn = staticmethod(_offgraph_attention)

    def __init__(self, model: nn.Module, max_context_len: int, logits_mode: str = "last", *,
                 prefill_chunk: Optional[int] = None, windows: Optional[Sequence[int]] = None,
                 initial_capacity: int = DEFAULT_INITIAL_CAPACITY, kv_dtype: Optional[torch.dtype] = None):
        super().__init__(model, logits_mode)
        self.layout = cache_layout(model.config.get_text_config(), windows)
        for m in attention_layers(model):
            m._offgraph_cache_id = self.layout.layer_cache[m.layer_idx]
        dtype = kv_dtype or next(model.parameters()).dtype
        self.cache = OffgraphCache(self.layout.specs, max_context_len, prefill_chunk or max_context_len,
                                   initial_capacity, dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if _is_tracing():
            return self._logits(tokens, positions)
        pos, T = int(positions[0]), int(positions.numel())
        if pos < self.cache.length:
            self.cache.rewind(pos)
        with bound(self.cache):
            logits = self._logits(tokens, positions)
        self.cache.commit(pos, T)
        return logits

    def reset(self) -> None:
        self.cache.reset()


# --------------------------------------------------------------------------------------------------
# the native cache for the ExecuTorch Python runtime (verify): libllmpipe_kernels.so via ctypes
# --------------------------------------------------------------------------------------------------
_NATIVE_LIB = None
_DTYPE_CODES = {torch.float16: 5, torch.float32: 6, torch.bfloat16: 15}


def load_native_kernels(path=None):
    """Loads libllmpipe_kernels.so with RTLD_GLOBAL (registers llmpipe::update_and_attend.out in the
    Python runtime's libexecutorch) and returns the ctypes handle. Idempotent."""
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
                            ("llmpipe_cache_reset", None, [vp]), ("llmpipe_cache_length", i64, [vp]),
                            ("llmpipe_cache_allocated", i64, [vp, c_int]),
                            ("llmpipe_cache_describe", ctypes.c_char_p, [vp]),
                            ("llmpipe_last_error", ctypes.c_char_p, [])]:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    _NATIVE_LIB = lib
    return lib


class NativeOffgraphCache:
    """The C++ OffgraphKvCache (native/src/offgraph_cache.h), driven from Python."""

    def __init__(self, specs: Sequence[LayerSpec], capacity: int, max_write: int,
                 initial_capacity: int = DEFAULT_INITIAL_CAPACITY, dtype: torch.dtype = torch.float32):
        import ctypes
        self._lib = lib = load_native_kernels()
        n = len(specs)
        arr = ctypes.c_int64 * max(n, 1)
        h = lib.llmpipe_cache_create(n, arr(*[s.kv_heads for s in specs]), arr(*[s.head_dim for s in specs]),
                                     arr(*[s.v_dim for s in specs]), arr(*[s.window for s in specs]),
                                     int(capacity), int(max_write), int(initial_capacity), _DTYPE_CODES[dtype])
        if not h:
            raise ValueError(self._error())
        self._h = h

    def _error(self) -> str:
        return self._lib.llmpipe_last_error().decode()

    def __del__(self):
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

    def bind(self) -> None:
        self._lib.llmpipe_cache_bind(self._h)

    def unbind(self) -> None:
        self._lib.llmpipe_cache_bind(None)

    def commit(self, pos: int, T: int) -> None:
        self._lib.llmpipe_cache_commit(self._h, pos, T)

    def rewind(self, target: int) -> None:
        if self._lib.llmpipe_cache_rewind(self._h, target) != 0:
            raise OffgraphCacheError(self._error())

    def reset(self) -> None:
        self._lib.llmpipe_cache_reset(self._h)

    def describe(self) -> str:
        return self._lib.llmpipe_cache_describe(self._h).decode()


def _constant(program, name: str):
    out = program.load_method(name).execute([])
    return out[0] if len(out) == 1 else list(out)


def _ints(x) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(i) for i in x.reshape(-1).tolist()]
    if isinstance(x, (list, tuple)):
        return [int(i) for i in x]
    return [int(x)]


def runtime_cache_plan(constant, names, windows: Optional[Sequence[int]] = None,
                       kv_dtype: Optional[torch.dtype] = None) -> tuple[list[LayerSpec], int, int, torch.dtype]:
    """The runtime cache an off-graph program asks for, read from its constant methods (`constant(name)`;
    `names` = the program's methods): (layer specs, context, max write, storage dtype). `windows` overrides
    the program's windows (a pattern repeated over the caches); the largest write is the chunk, bounded by
    the smallest ring window."""
    n = int(_ints(constant("get_n_caches"))[0])
    heads = _ints(constant("get_kv_heads"))
    dims = _ints(constant("get_head_dims"))
    vdims = _ints(constant("get_v_head_dims")) if "get_v_head_dims" in names else dims
    wins = _ints(constant("get_windows"))
    if windows:
        wins = [int(windows[i % len(windows)]) for i in range(n)]
    chunk = int(_ints(constant("get_max_seq_len"))[0])
    ctx = int(_ints(constant("get_max_context_len"))[0])
    act = int(_ints(constant("get_activation_dtype"))[0])
    dtype = kv_dtype or {5: torch.float16, 6: torch.float32, 15: torch.bfloat16}[act]
    specs = [LayerSpec(heads[i], dims[i], vdims[i], wins[i]) for i in range(n)]
    return specs, ctx, min([chunk] + [w for w in wins if w > 0]), dtype


class OffgraphPteModule:
    """An offgraph .pte in the ExecuTorch Python runtime, callable like the eager wrapper:
    (tokens [1,T], positions [T]) -> logits. Owns a NativeOffgraphCache built from the program's
    constant methods; a step starting before the cache length rewinds first (0 = new sequence)."""

    def __init__(self, path, capacity: Optional[int] = None, initial_capacity: int = DEFAULT_INITIAL_CAPACITY,
                 kv_dtype: Optional[torch.dtype] = None, windows: Optional[Sequence[int]] = None):
        from executorch.runtime import Runtime

        from pipeline.runtime import load_kernels
        load_kernels()
        load_native_kernels()
        self.program = Runtime.get().load_program(str(path))
        names = set(self.program.method_names)
        if "get_n_caches" not in names:
            raise ValueError(f"{path} is not an offgraph program (no get_n_caches)")
        specs, ctx, self.chunk, dtype = runtime_cache_plan(lambda name: _constant(self.program, name), names,
                                                           windows, kv_dtype)
        self.cache = NativeOffgraphCache(specs, capacity or ctx, self.chunk, initial_capacity, dtype)
        self.forward = self.program.load_method("forward")

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pos, T = int(positions[0]), int(positions.numel())
        if pos < self.cache.length:
            self.cache.rewind(pos)
        self.cache.check_step(pos, T)
        self.cache.bind()
        try:
            out = self.forward.execute([tokens, positions])[0]
        finally:
            self.cache.unbind()
        self.cache.commit(pos, T)
        return out

    def reset(self) -> None:
        self.cache.reset()
