"""What the `custom` and `offgraph` cache modes share: the reference attention over a gathered history,
the registration of our ops, and the wrapper base that switches an HF model's attention to one of our ops
for the duration of a call.

The C++ twin of `attend_gathered` is native/src/kernels/kv_attention.cpp (one core for both modes).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from pipeline.model import archs
from pipeline.model.layers.logits_rows import tail_indices


DEFAULT_TAIL_ROWS = 4  # export.tail_rows' default, for a module wrapped before it was set


def logits_to_keep(logits_mode: str, tokens: torch.Tensor, rows: Optional[torch.Tensor] = None,
                   tail_rows: int = DEFAULT_TAIL_ROWS):
    """HF's `logits_to_keep` for a logits mode: 0 = every row (`full`), 1 = the last (`last`, and `selected`
    called without rows), the last min(T, tail_rows) row indices (`tail`), else the rows asked (`selected`)."""
    if logits_mode == "selected" and rows is not None:
        return rows.reshape(-1)
    if logits_mode == "tail":
        return tail_indices(tokens.shape[1], tail_rows)
    return 0 if logits_mode == "full" else 1


def check_step(op: str, q, k, v, position) -> tuple[int, int]:
    """Shapes of one attention step (q [1,Hq,T,D], k [1,Hkv,T,D], v [1,Hkv,T,Dv], Hq % Hkv == 0,
    position [T] consecutive); returns (pos, T)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{op}: q, k, v must be 4-d [B,H,T,D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, T, D = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[2] != T or v.shape[2] != T or k.shape[3] != D \
            or v.shape[1] != k.shape[1]:
        raise ValueError(f"{op}: inconsistent shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if Hq % k.shape[1] != 0:
        raise ValueError(f"{op}: {Hq} query heads are not a multiple of {k.shape[1]} KV heads")
    if B != 1:
        raise ValueError(f"{op}: batch must be 1, got {B}")
    if position.numel() != T:
        raise ValueError(f"{op}: position has {position.numel()} entries for T={T}")
    pos_list = position.reshape(-1).tolist()
    pos = int(pos_list[0])
    if pos_list != list(range(pos, pos + T)):
        raise ValueError(f"{op}: positions must be consecutive, got {pos_list}")
    return pos, T


# the step's positions [1,T] while a wrapper runs the model, for a decoder layer that does not hand HF's
# position_ids on to its attention (Granite-4.0-H's); a plain dict, which torch.export's tracer follows
_STEP: dict = {}


@contextlib.contextmanager
def step_positions(positions: torch.Tensor):
    """Publish the step's positions [1,T] to the attention functions for the duration of one model call."""
    _STEP["positions"] = positions
    try:
        yield
    finally:
        _STEP.pop("positions", None)


def step_args(op: str, query: torch.Tensor, scaling, kwargs) -> tuple[torch.Tensor, float]:
    """What every cache-mode attention function takes from HF's attention-interface call: the step's positions
    (the wrapper passes positions[None] as position_ids, and publishes them: step_positions) and the softmax scale
    (HF's default when None)."""
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = _STEP.get("positions")
    if positions is None:
        raise RuntimeError(f"{op} attention needs position_ids (the wrapper passes positions[None])")
    return positions, float(scaling if scaling is not None else query.shape[-1] ** -0.5)


def attend_gathered(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pos: int, base: int, window: int,
                    scale: float, out_dtype, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [1,Hq,T,D] at positions pos.., K [Hkv,S,D] / V [Hkv,S,Dv] at positions base..; fp32 softmax.

    Key j is visible to query i iff key <= query and, with a window w > 0, key > query - w. `sinks` [Hq] (gpt-oss):
    a logit per head that every row's softmax also counts, whose value is zero."""
    T = q.shape[2]
    group = q.shape[1] // K.shape[0]
    K = K.float().repeat_interleave(group, 0)
    V = V.float().repeat_interleave(group, 0)
    scores = torch.matmul(q[0].float(), K.transpose(1, 2)) * scale  # [Hq,T,S]
    qpos = torch.arange(pos, pos + T).unsqueeze(1)
    kpos = torch.arange(base, base + K.shape[1]).unsqueeze(0)
    visible = kpos <= qpos
    if window > 0:
        visible &= kpos > qpos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.float().reshape(-1, 1, 1).expand(scores.shape[0], T, 1)
        probs = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return torch.matmul(probs, V).unsqueeze(0).to(out_dtype)  # [1,Hq,T,Dv]


def define_op(namespace: str, name: str, args: str, out_alias: str, eager, fake):
    """Register `namespace::name(args) -> Tensor` and the `.out` variant that ExecuTorch's to_executorch
    calls (eager: compute, then copy into out; fake: out itself). Returns the library: keep it alive."""
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define(f"{name}({args}) -> Tensor")
    lib.define(f"{name}.out({args}, *, Tensor({out_alias}!) out) -> Tensor({out_alias}!)")

    def eager_out(*a, out):
        res = eager(*a)
        out.resize_(res.shape)
        return out.copy_(res)

    def fake_out(*a, out):
        return out

    lib.impl(name, eager, "CompositeExplicitAutograd")
    lib.impl(f"{name}.out", eager_out, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{namespace}::{name}", fake, lib=lib)
    torch.library.register_fake(f"{namespace}::{name}.out", fake_out, lib=lib)
    return lib


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The HF attention module of every attention layer (a recurrent layer has none), where the architecture's entry
    says it is."""
    arch = archs.of_model(model)
    return [arch.attention_module(layer) for _, layer in arch.attention_layers(model)]


def sinks_arg(kwargs: dict) -> Optional[torch.Tensor]:
    """The per-head sink logits HF's attention call hands the attention function (gpt-oss: `s_aux`), fp32; or None."""
    s = kwargs.get("s_aux")
    return None if s is None else s.float()


def kv_source(module: nn.Module) -> nn.Module:
    """The attention module whose cache `module` attends over: itself, or a KV-shared layer's (Gemma 4) source."""
    return module.__dict__.get("_kv_source", module)


def link_kv_sources(layers: list[nn.Module], layout) -> dict[int, nn.Module]:
    """Point every attention module at the module that owns its cache (a KV-shared layer: its source layer's, by
    the CacheLayout), as a plain attribute, not a submodule: the source's buffers are read, never a second copy.
    Returns cache index -> owning module."""
    owners = {layout.layer_cache[m.layer_idx]: m for m in layers if not layout.is_readonly(m.layer_idx)}
    for m in layers:
        m.__dict__["_kv_source"] = owners[layout.layer_cache[m.layer_idx]]
    return owners


def query_positions(positions: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The positions of the query rows an attention function gets: the step's, or its last rows only (HF runs
    Gemma 4's KV-shared layers on the rows whose logits are kept, `_maybe_slice_kv_shared_inputs`)."""
    return positions.reshape(-1)[-query.shape[2]:]


class HookedAttentionLM(nn.Module):
    """Runner layout (tokens Long[1,T], positions Long[T]) -> logits over an HF causal LM whose attention
    implementation is switched to `attn_fn` (an HF attention-interface function, registered as `attn_impl`)
    during each call."""

    tail_rows = DEFAULT_TAIL_ROWS  # logits mode `tail`: cache_modes.wrap sets the build's

    def __init__(self, model: nn.Module, logits_mode: str, attn_impl: str, attn_fn):
        super().__init__()
        self.model = model
        self.logits_mode = logits_mode
        self.use_attention(attn_impl, attn_fn)
        self._attn_configs = []
        for m in attention_layers(model):
            if all(c is not m.config for c in self._attn_configs):
                self._attn_configs.append(m.config)

    def use_attention(self, attn_impl: str, attn_fn) -> None:
        """The attention function the wrapper installs (a backend may swap in the op its delegate lowers);
        `attn_fn` is a module-level function, so a pickled wrapper keeps it by name."""
        self.attn_impl, self.attn_fn = attn_impl, attn_fn

    @contextlib.contextmanager
    def _attn_impl(self):
        # registered here, not in __init__: a module unpickled from the stage cache skips __init__
        from transformers import AttentionInterface
        AttentionInterface.register(self.attn_impl, self.attn_fn)
        saved = [c._attn_implementation for c in self._attn_configs]
        for c in self._attn_configs:
            c._attn_implementation = self.attn_impl
        try:
            yield
        finally:
            for c, s in zip(self._attn_configs, saved):
                c._attn_implementation = s

    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor,
                 rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`rows` (logits mode `selected`): the rows whose logits come back, [1, R, V]; without it a `selected`
        wrapper returns the last row, as `last` does (what a single-session caller asks)."""
        # positions go to HF explicitly and no HF cache: HF would derive them from an empty cache
        keep = logits_to_keep(self.logits_mode, tokens, rows, self.tail_rows)
        with self._attn_impl(), step_positions(positions.unsqueeze(0)):
            return self.model(input_ids=tokens, position_ids=positions.unsqueeze(0), use_cache=False,
                              logits_to_keep=keep).logits
