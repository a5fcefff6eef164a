"""The `custom` cache mode's two halves taken one at a time, as ExecuTorch's llama::custom_sdpa and
llama::update_cache can be (cache.custom_sdpa / cache.custom_kv_cache alone):

    llmpipe::sdpa(q, k_cache, v_cache, position, window, scale) -> out        reads the cache, attends
    llmpipe::update_cache(k, v, k_cache!, v_cache!, position) -> Tensor[1]   writes this step in place

- Caches are BHSD [1, Hkv, S, D] (HF's StaticCache layout), flat: slot = position, S = the max context.
  Sliding layers keep the whole context (rings are the fused op's) and are masked to their window.
- q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv] (RoPE-rotated), position [T] consecutive; sdpa attends over
  keys [max(0, pos-w+1) or 0, pos+T) in fp32 and returns [1,Hq,T,Dv] in q's dtype.
- custom_sdpa alone (`SdpaStaticCacheLM`): HF's own StaticCache writes K/V (index_copy_ into its buffers),
  then llmpipe::sdpa reads them. custom_kv_cache alone (`UpdateCacheLM`): llmpipe::update_cache writes the
  layer's buffers, then the standard attention math (matmuls, a mask from the positions, softmax) in the graph.
- A KV-shared layer (Gemma 4) has no cache of its own and writes nothing: it reads its source layer's, written
  earlier in the same forward (custom_sdpa alone: HF hands it the source's StaticCache buffers and keeps a DummyLayer
  for it; custom_kv_cache alone: the source module's buffers), for its query rows, possibly only the step's last
  ones (HF runs the shared layers on the kept logits' rows): their positions are the step's last ones.
The C++ kernels are native/src/kernels/split_kernels.cpp (the attention core of the other two ops).
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.model.layers.attention import (HookedAttentionLM, attend_gathered, attention_layers, define_op, kv_source,
                                             link_kv_sources, logits_to_keep, query_positions, step_args,
                                             step_positions)
from pipeline.model.kv.hf_static_cache import attach_static_cache, reset_static_cache, start_step
from pipeline.model.kv.layout import cache_layout

NAMESPACE = "llmpipe"
SDPA, UPDATE = f"{NAMESPACE}::sdpa", f"{NAMESPACE}::update_cache"


def _positions(op: str, position, T: int, slots: int) -> int:
    pos_list = position.reshape(-1).tolist()
    if len(pos_list) != T:
        raise ValueError(f"{op}: position has {len(pos_list)} entries for T={T}")
    pos = int(pos_list[0]) if pos_list else 0
    if pos < 0 or pos_list != list(range(pos, pos + T)):
        raise ValueError(f"{op}: positions must be consecutive and >= 0, got {pos_list}")
    if pos + T > slots:
        raise ValueError(f"{op}: positions [{pos}, {pos + T}) exceed the cache's {slots} positions (the max context)")
    return pos


def _check_cache(op: str, cache, heads: int, dim: int, name: str) -> None:
    if cache.dim() != 4 or cache.shape[0] != 1 or cache.shape[1] != heads or cache.shape[3] != dim:
        raise ValueError(f"{op}: {name} must be [1, {heads}, S, {dim}], got {tuple(cache.shape)}")


def sdpa_ref(q, k_cache, v_cache, position, window: int, scale: float) -> torch.Tensor:
    """Attend over the cached keys [base, pos+T) of a flat BHSD cache (window > 0: the band of the window)."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"{SDPA}: q must be [1,Hq,T,D], got {tuple(q.shape)}")
    hkv = k_cache.shape[1] if k_cache.dim() == 4 else 0
    _check_cache(SDPA, k_cache, hkv, q.shape[3], "k_cache")
    _check_cache(SDPA, v_cache, hkv, v_cache.shape[-1], "v_cache")
    if hkv == 0 or q.shape[1] % hkv or v_cache.shape[2] != k_cache.shape[2]:
        raise ValueError(f"{SDPA}: {q.shape[1]} query heads over caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if window < 0:
        raise ValueError(f"{SDPA}: negative window {window}")
    T = q.shape[2]
    pos = _positions(SDPA, position, T, k_cache.shape[2])
    base = max(0, pos - window + 1) if window > 0 else 0
    return attend_gathered(q, k_cache[0, :, base:pos + T], v_cache[0, :, base:pos + T], pos, base, window, scale,
                           q.dtype)


def update_cache_ref(k, v, k_cache, v_cache, position) -> torch.Tensor:
    """Write k [1,Hkv,T,D] / v [1,Hkv,T,Dv] at positions [pos, pos+T) of the caches, in place."""
    if k.dim() != 4 or v.dim() != 4 or k.shape[0] != 1 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"{UPDATE}: k, v must be [1,Hkv,T,D] and [1,Hkv,T,Dv], got {tuple(k.shape)}, {tuple(v.shape)}")
    _check_cache(UPDATE, k_cache, k.shape[1], k.shape[3], "k_cache")
    _check_cache(UPDATE, v_cache, v.shape[1], v.shape[3], "v_cache")
    if v_cache.shape[2] != k_cache.shape[2]:
        raise ValueError(f"{UPDATE}: caches of {k_cache.shape[2]} and {v_cache.shape[2]} positions")
    T = k.shape[2]
    pos = _positions(UPDATE, position, T, k_cache.shape[2])
    k_cache[0, :, pos:pos + T] = k[0].to(k_cache.dtype)
    v_cache[0, :, pos:pos + T] = v[0].to(v_cache.dtype)
    return k.new_zeros((1,))


def _define() -> None:
    def sdpa(q, k_cache, v_cache, position, window, scale):
        return sdpa_ref(q, k_cache, v_cache, position, int(window), float(scale))

    def sdpa_fake(q, k_cache, v_cache, position, window, scale):
        return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v_cache.shape[3]))

    def update_fake(k, v, k_cache, v_cache, position):
        return k.new_empty((1,))

    globals()["_LIBS"] = (
        define_op(NAMESPACE, "sdpa", "Tensor q, Tensor k_cache, Tensor v_cache, Tensor position, int window, "
                  "float scale", "a", sdpa, sdpa_fake),
        define_op(NAMESPACE, "update_cache", "Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
                  "Tensor position", "c", update_cache_ref, update_fake))


if not hasattr(getattr(torch.ops, NAMESPACE), "sdpa"):
    _define()


def _layer_windows(model: nn.Module) -> list[tuple[nn.Module, object]]:
    """(attention module, the LayerSpec of the cache it reads) per layer, each module linked to the module owning
    that cache (kv_source: itself, or a KV-shared layer's source)."""
    layout = cache_layout(model.config.get_text_config())
    layers = attention_layers(model)
    link_kv_sources(layers, layout)
    return [(m, layout.specs[layout.layer_cache[m.layer_idx]]) for m in layers]


def _step_positions(module, query, positions) -> torch.Tensor:
    """This call's query positions: the step's, or a KV-shared layer's rows (possibly the step's last ones)."""
    return query_positions(positions, query) if kv_source(module) is not module else positions.reshape(-1)


# --- custom_sdpa alone: HF's StaticCache writes, llmpipe::sdpa reads ------------------------------------------

def _sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """key/value are HF's whole static cache [1,Hkv,S,D], this step already written by index_copy_ (a KV-shared
    layer: its source layer's, which HF passes on from the source's update)."""
    positions, scaling = step_args("custom_sdpa", query, scaling, kwargs)
    out = torch.ops.llmpipe.sdpa(query, key, value, _step_positions(module, query, positions), module.sdpa_window,
                                 scaling)
    return out.transpose(1, 2).contiguous(), None


class SdpaStaticCacheLM(HookedAttentionLM):
    """HF's static in-graph cache (mutable buffers HF updates), attention by llmpipe::sdpa over them. KV-shared
    layers keep HF's DummyLayer (attach_static_cache): no buffers, they read their source layer's."""

    def __init__(self, model: nn.Module, max_context_len: int, logits_mode: str = "last"):
        super().__init__(model, logits_mode, "llmpipe_sdpa", _sdpa_attention)
        for m, spec in _layer_windows(model):
            m.sdpa_window = int(spec.window)
        self.cache = attach_static_cache(self, model, max_context_len)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        start_step(self.cache, positions)
        with self._attn_impl(), step_positions(positions.unsqueeze(0)):
            keep = logits_to_keep(self.logits_mode, tokens, None, self.tail_rows)
            return self.model(input_ids=tokens, position_ids=positions.unsqueeze(0), past_key_values=self.cache,
                              use_cache=True, logits_to_keep=keep).logits

    def reset(self) -> None:
        reset_static_cache(self.cache)


# --- custom_kv_cache alone: llmpipe::update_cache writes, standard attention math reads -------------------------

def _update_cache_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    positions, scaling = step_args("custom_kv_cache", query, scaling, kwargs)
    src = kv_source(module)
    pos = _step_positions(module, query, positions)
    if src is module:  # a KV-shared layer writes nothing: its source wrote this step earlier in this forward
        torch.ops.llmpipe.update_cache(key, value, module.kv_k_cache, module.kv_v_cache, pos)
    K, V = src.kv_k_cache, src.kv_v_cache                        # [1,Hkv,S,D], this step written
    hkv, S = K.shape[1], K.shape[2]
    group = query.shape[1] // hkv
    if group > 1:  # GQA as HF's repeat_kv does it
        K = K[:, :, None].expand(1, hkv, group, S, K.shape[3]).reshape(1, hkv * group, S, K.shape[3])
        V = V[:, :, None].expand(1, hkv, group, S, V.shape[3]).reshape(1, hkv * group, S, V.shape[3])
    kpos = torch.arange(S, device=query.device)[None, :]
    qpos = pos[:, None]
    visible = kpos <= qpos
    if src.kv_mask_window > 0:
        visible = visible & (kpos > qpos - src.kv_mask_window)
    scores = torch.matmul(query.float(), K.float().transpose(2, 3)) * scaling
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), V.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


class UpdateCacheLM(HookedAttentionLM):
    """In-graph BHSD cache buffers per attention layer written by llmpipe::update_cache; standard attention.
    A KV-shared layer has no buffers: it reads its source layer's (kv_source)."""

    def __init__(self, model: nn.Module, max_context_len: int, logits_mode: str = "last"):
        super().__init__(model, logits_mode, "llmpipe_update_cache", _update_cache_attention)
        dtype = next(model.parameters()).dtype
        for m, spec in _layer_windows(model):
            m.kv_mask_window = int(spec.window)
            if kv_source(m) is not m:
                continue
            m.register_buffer("kv_k_cache", torch.zeros(1, spec.kv_heads, max_context_len, spec.head_dim,
                                                        dtype=dtype), persistent=False)
            m.register_buffer("kv_v_cache", torch.zeros(1, spec.kv_heads, max_context_len, spec.v_dim,
                                                        dtype=dtype), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._logits(tokens, positions)

    def reset(self) -> None:
        for n, b in self.named_buffers():
            if n.endswith(("kv_k_cache", "kv_v_cache")):
                b.zero_()
