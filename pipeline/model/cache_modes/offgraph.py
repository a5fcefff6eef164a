"""The `offgraph` KV-cache mode: attention layers call one op, the cache lives in the runtime.

    llmpipe::update_and_attend(q, k, v, position, cache_id, scale, out_dtype, sinks=None) -> out

- q [B,Hq,T,D], k [B,Hkv,T,D], v [B,Hkv,T,Dv] (q and k already RoPE-rotated, Hq % Hkv == 0),
  position [T] (or [T,1]) int, contiguous positions pos..pos+T-1; returns [B,Hq,T,Dv] in out_dtype.
- sinks: None, or fp32 [Hq] (gpt-oss): a logit per head that every row's softmax also counts, with a zero value.
- To the tracer the op is functional (no mutated args; the fake impl returns an empty tensor of the
  output shape), so the exported graph has no buffers and no mutations: one op per attention layer.
  `llmpipe::update_and_attend.out` is the out variant that `to_executorch` emits.
- Semantics: write this step's K/V at logical positions [pos, pos+T) of cache `cache_id` of the bound
  cache (pipeline/model/kv/runtime_cache.py), then attend over the cached history (fp32, cast to
  out_dtype) with the causal mask, banded on sliding layers. The C++ kernel is native/'s.
- The program publishes the cache geometry (get_n_caches, get_kv_heads, get_head_dims, get_windows)
  so a runtime can build the cache it needs.
- A KV-shared layer (Gemma 4's num_kv_shared_layers) has no cache: it calls
  `llmpipe::attend_cached(q, position, cache_id, scale, out_dtype)` on its source layer's cache, which
  reads without writing (out [B,Hq,Tq,D]: values as wide as keys); its Tq query rows may be only the
  step's last ones. The program also publishes get_n_shared_layers (how many), for the cache report.
- Recurrent layers (Qwen3.5, LFM2) keep their state in the runtime's cache too: their mixers call
  llmpipe::state_conv / llmpipe::state_delta with a state id (pipeline/model/layers/recurrent.py), and the program
  publishes get_layer_kinds / get_state_shapes, from which the runtime sizes it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from pipeline.model.layers import recurrent
from pipeline.model.layers.attention import (HookedAttentionLM, attend_gathered, attention_layers, check_step,
                                             define_op, link_kv_sources, sinks_arg, step_args)
from pipeline.model.layers.key_calibration import keys_in, queries_in
from pipeline.model.kv.layout import cache_layout
from pipeline.model.kv.runtime_cache import (DEFAULT_INITIAL_CAPACITY, OffgraphCache, OffgraphCacheError,
                                           bound_cache, run_step)

FLAGS = ({"custom_sdpa": False, "custom_kv_cache": False},)
FLAGS_WHY = "the off-graph op owns attention and the cache itself: neither flag"
RUNTIME_OWNED = True      # the runner sizes the cache per run (verify.runtime, --kv-* flags)
KERNELS = ("llmpipe",)    # llmpipe::update_and_attend.out: native/'s kernel library
EXECUTORCH_OPS_ONLY = False  # export may add our ops (the tied head, the experts)
LOGITS_MODES = ("full", "last", "tail", "selected")  # export.logits_mode values


def takes_rows(flags: dict) -> bool:
    return True


def sdpa_with_kv_cache(flags: dict) -> bool:
    return True  # one op per layer updates the runtime's cache and attends

NAMESPACE = "llmpipe"
OP_NAME = "update_and_attend"
QUALNAME = f"{NAMESPACE}::{OP_NAME}"
READ_OP_NAME = "attend_cached"   # a KV-shared layer's read-only attend over its source layer's cache
READ_QUALNAME = f"{NAMESPACE}::{READ_OP_NAME}"
ATTN_IMPL = "llmpipe_offgraph"  # the HF attention-implementation name the wrapper switches to


def attend(cache: OffgraphCache, q, k, v, position, cache_id: int, scale: float, out_dtype, sinks=None) -> torch.Tensor:
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
    return attend_gathered(q, K, V, pos, plan.base, spec.window, scale, out_dtype, sinks)


def attend_readonly(cache: OffgraphCache, q, position, cache_id: int, scale: float, out_dtype,
                    sinks=None) -> torch.Tensor:
    """A KV-shared layer: attend over cache `cache_id` (its source layer's, written earlier in this forward)
    without writing; queries at the positions given (the last T_q of the step)."""
    T = q.shape[2]
    pos_list = position.reshape(-1).tolist()
    if len(pos_list) != T or pos_list != list(range(pos_list[0], pos_list[0] + T)):
        raise ValueError(f"{READ_QUALNAME}: position must be {T} consecutive entries, got {pos_list}")
    plan = cache.plan_read(cache_id, int(pos_list[0]), T)
    spec = cache.specs[cache_id]
    if spec.head_dim != q.shape[3] or q.shape[1] % spec.kv_heads:
        raise OffgraphCacheError(f"cache {cache_id} holds {spec} but the query is {tuple(q.shape)}")
    K, V = cache.gather(plan)
    return attend_gathered(q, K, V, plan.pos, plan.base, spec.window, scale, out_dtype, sinks)


def _define() -> None:
    def eager(q, k, v, position, cache_id, scale, out_dtype, sinks=None):
        try:
            cache = bound_cache()
        except OffgraphCacheError as e:
            raise OffgraphCacheError(f"{QUALNAME}: {e}") from None
        return attend(cache, q, k, v, position, int(cache_id), float(scale), out_dtype, sinks)

    def fake(q, k, v, position, cache_id, scale, out_dtype, sinks=None):
        return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), dtype=out_dtype)

    globals()["_LIB"] = define_op(
        NAMESPACE, OP_NAME, "Tensor q, Tensor k, Tensor v, Tensor position, int cache_id, float scale, "
        "ScalarType out_dtype, Tensor? sinks=None", "a", eager, fake)


def _define_readonly() -> None:
    def eager(q, position, cache_id, scale, out_dtype, sinks=None):
        try:
            cache = bound_cache()
        except OffgraphCacheError as e:
            raise OffgraphCacheError(f"{READ_QUALNAME}: {e}") from None
        return attend_readonly(cache, q, position, int(cache_id), float(scale), out_dtype, sinks)

    def fake(q, position, cache_id, scale, out_dtype, sinks=None):
        return q.new_empty(q.shape, dtype=out_dtype)

    globals()["_LIB_READ"] = define_op(
        NAMESPACE, READ_OP_NAME, "Tensor q, Tensor position, int cache_id, float scale, ScalarType out_dtype, "
        "Tensor? sinks=None", "a", eager, fake)


if not hasattr(torch.ops, NAMESPACE) or not hasattr(getattr(torch.ops, NAMESPACE), OP_NAME):
    _define()
if not hasattr(getattr(torch.ops, NAMESPACE), READ_OP_NAME):
    _define_readonly()

update_and_attend = torch.ops.llmpipe.update_and_attend


def exports_non_strict(flags: dict) -> bool:
    return True  # its op and cache trace the same without dynamo


def rings(flags: dict) -> bool:
    return True  # sliding layers hold window + chunk - 1 slots


def constant_methods(cfg, context: int, chunk: int, flags: dict) -> dict:
    """The cache geometry the .pte publishes (beside the runner layout's constant methods)."""
    lay = cache_layout(cfg)
    methods = {
        "get_n_caches": lay.n_caches,
        "get_kv_heads": torch.tensor([s.kv_heads for s in lay.specs], dtype=torch.long),
        "get_head_dims": torch.tensor([s.head_dim for s in lay.specs], dtype=torch.long),
        "get_windows": torch.tensor([s.window for s in lay.specs], dtype=torch.long),
    }
    if lay.n_shared:
        methods["get_n_shared_layers"] = lay.n_shared
    if any(s.v_dim != s.head_dim for s in lay.specs):
        methods["get_v_head_dims"] = torch.tensor([s.v_dim for s in lay.specs], dtype=torch.long)
    return {**methods, **recurrent.state_methods(cfg, rings=True)}


def _offgraph_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        sliding_window=None, **kwargs):
    """HF attention-interface function: q/k arrive RoPE-rotated, [B,H,T,D]; returns ([B,T,H,Dv], None)."""
    positions, scaling = step_args("offgraph", query, scaling, kwargs)
    cache_id = getattr(module, "_offgraph_cache_id", None)
    if cache_id is None:
        raise RuntimeError(f"offgraph attention: layer {getattr(module, 'layer_idx', '?')} has no cache id")
    if getattr(module, "_offgraph_readonly", False):
        # a KV-shared layer: key/value are its source's, already in the cache; HF may have kept only the
        # last rows of the step for it (logits_to_keep), so its queries sit at the step's last positions
        out = torch.ops.llmpipe.attend_cached(queries_in(module, query), positions.reshape(-1)[-query.shape[2]:],
                                              cache_id, scaling, query.dtype, sinks_arg(kwargs))
        return out.transpose(1, 2).contiguous(), None
    # a calibrated build's cache holds (k - m) * a, its queries enter as q / a
    # (pipeline/model/layers/key_calibration.py)
    out = torch.ops.llmpipe.update_and_attend(queries_in(module, query), keys_in(module, key), value,
                                              positions.reshape(-1), cache_id, scaling, query.dtype, sinks_arg(kwargs))
    return out.transpose(1, 2).contiguous(), None


def _is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.compiler.is_exporting()


class OffgraphLM(HookedAttentionLM):
    """Runner layout over an HF causal LM whose attention calls llmpipe::update_and_attend.

    forward(tokens Long[1,T], positions Long[T]) -> logits. Exported, the graph holds no cache. Run
    eagerly, the wrapper owns an OffgraphCache (`self.cache`) and runs each call as a step against it.
    """

    def __init__(self, model: nn.Module, max_context_len: int, logits_mode: str = "last", *,
                 prefill_chunk: Optional[int] = None, windows: Optional[Sequence[int]] = None,
                 initial_capacity: int = DEFAULT_INITIAL_CAPACITY, kv_dtype: Optional[torch.dtype] = None):
        super().__init__(model, logits_mode, ATTN_IMPL, _offgraph_attention)
        self.layout = cache_layout(model.config.get_text_config(), windows)
        layers = attention_layers(model)
        for m in layers:
            m._offgraph_cache_id = self.layout.layer_cache[m.layer_idx]
            m._offgraph_readonly = self.layout.is_readonly(m.layer_idx)
        link_kv_sources(layers, self.layout)  # a KV-shared layer's queries take its source's key transform
        dtype = kv_dtype or next(model.parameters()).dtype
        self.cache = OffgraphCache(self.layout.specs, max_context_len, prefill_chunk or max_context_len,
                                   initial_capacity, dtype)
        self.cache.shared_layers = self.layout.n_shared
        # recurrent layers: their state in the cache, a state id each
        recurrent.install_mixers(model, next(model.parameters()).dtype, runtime_state=True)
        methods = recurrent.state_methods(model.config.get_text_config(), rings=True)
        if methods:
            self.cache.set_states(methods["get_state_shapes"].tolist())

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        with recurrent.step_positions(self, positions):
            if _is_tracing():
                return self._logits(tokens, positions, rows)
            return run_step(self.cache, positions, lambda: self._logits(tokens, positions, rows))

    def reset(self) -> None:
        self.cache.reset()


def kv_dtype_refused(flags: dict) -> str | None:
    return ("the runtime owns the storage and picks its dtype per run: verify.runtime.kv_storage_dtype, the runners' "
            "--kv-storage-dtype")


def wrap(model: nn.Module, context: int, logits_mode: str, chunk: int, flags: dict, kv_dtype=None) -> nn.Module:
    return OffgraphLM(model, context, logits_mode, prefill_chunk=chunk)


def refuses_arch(arch, flags: dict) -> str | None:
    return None  # its ops take sinks; recurrent layers' state is the runtime's
