"""Recurrent layers (pipeline/model/archs: RECURRENT_KINDS) in a form that exports: each layer's token mixer replaced
by one that advances its state with our ops, a step of any length at a time. The state is in buffers of the program
(custom and static modes) or in the runtime's off-graph cache (llmpipe::state_conv / state_delta with a state id).

    llmpipe::causal_conv(x, weight, bias?, state!, position, activation) -> out

- x [1,T,C]; weight [C,K] (a depthwise conv over the last K inputs of each channel); bias [C] or None; state [K-1,C]
  in x's dtype: the last K-1 inputs before this step (zeroed first when position[0] == 0); activation 0: none, 1: silu.
- out[t] = act(bias + sum_j weight[:, j] * in[t + j]) over in = state then x; the state becomes in's last K-1 rows.

A Gated DeltaNet layer (Qwen3.5) runs its q|k|v through that conv (silu), then llmpipe::gated_delta_rule
(pipeline/model/layers/gated_delta.py) over its [value heads, key dim, value dim] fp32 state; a short-conv layer (LFM2)
computes C * conv(B * x); a Mamba-2 layer (Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1) runs its x|B|C through the
conv (silu), then llmpipe::ssd_scan (pipeline/model/layers/ssd.py) over its [heads, state size, head dim] fp32 state.
The mixers read the step's positions from the wrapper (`step_positions`): a step at 0 starts a new sequence. The
weights stay the HF module's (the same names, so quantization finds the linears where the geometry lists them); the
conv weights, A_log, dt_bias, D and the norms stay in float. A layer's matrix state, a DeltaNet's or a Mamba-2
layer's, is its "delta" part (the runtime cache stores either as one fp32 matrix per head).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from pipeline.model import archs
from pipeline.model.layers import gated_delta  # defines llmpipe::gated_delta_rule
from pipeline.model.layers import ssd  # defines llmpipe::ssd_scan
from pipeline.model.layers.attention import define_op

NAMESPACE = "llmpipe"
CONV_OP = "causal_conv"
CONV_QUALNAME = f"{NAMESPACE}::{CONV_OP}"
ACTIVATIONS = {"none": 0, "silu": 1}


def causal_conv_ref(x, weight, bias, state, position, activation: int) -> torch.Tensor:
    """Reference semantics (eager, float64 inside): convolve the step over the state, then keep its last inputs."""
    if x.dim() != 3 or x.shape[0] != 1 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"{CONV_QUALNAME}: x must be [1,T,C] and weight [C,K], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    T, C = x.shape[1:]
    K = weight.shape[1]
    if state.shape != (K - 1, C) or state.dtype != x.dtype:
        raise ValueError(f"{CONV_QUALNAME}: state must be [{K - 1},{C}] in x's dtype, got {state.dtype} "
                         f"{tuple(state.shape)}")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"{CONV_QUALNAME}: bias must be [{C}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS.values():
        raise ValueError(f"{CONV_QUALNAME}: activation {activation}: allowed {ACTIVATIONS}")
    if gated_delta.step_start(CONV_QUALNAME, position, T) == 0:
        state.zero_()
    seq = torch.cat([state, x[0]]).to(torch.float64)                              # [K-1+T, C]
    w = weight.to(torch.float64)
    out = sum(w[:, j] * seq[j:j + T] for j in range(K))
    if bias is not None:
        out = out + bias.to(torch.float64)
    if activation == ACTIVATIONS["silu"]:
        out = out * torch.sigmoid(out)
    state.copy_(seq[T:].to(state.dtype))
    return out.unsqueeze(0).to(x.dtype)


def _define() -> None:
    def eager(x, weight, bias, state, position, activation):
        return causal_conv_ref(x, weight, bias, state, position, int(activation))

    def fake(x, weight, bias, state, position, activation):
        return x.new_empty(x.shape)

    globals()["_LIB"] = define_op(
        NAMESPACE, CONV_OP, "Tensor x, Tensor weight, Tensor? bias, Tensor(a!) state, Tensor position, "
        "int activation", "b", eager, fake)


if not hasattr(getattr(torch.ops, NAMESPACE), CONV_OP):
    _define()


def _define_state_ops() -> None:
    """The off-graph mode's twins of the two ops: the state is the bound runtime cache's (state `state_id`)."""
    from pipeline.model.kv.runtime_cache import OffgraphCacheError, bound_cache

    def state(state_id: int, name: str) -> torch.Tensor:
        cache = bound_cache()
        if not 0 <= state_id < len(cache.states) or name not in cache.states[state_id]:
            raise OffgraphCacheError(f"state_id {state_id}: the bound cache has {len(cache.states)} states, "
                                     f"none with a {name!r} part there")
        return cache.states[state_id][name]

    def conv(x, weight, bias, position, state_id, activation):
        return causal_conv_ref(x, weight, bias, state(int(state_id), "conv"), position, int(activation))

    def delta(q, k, v, a, b, A_log, dt_bias, position, state_id, scale):
        return gated_delta.gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, state(int(state_id), "delta"), position,
                                                float(scale))

    def scan(x, dt, A_log, dt_bias, B, C, D, position, state_id, dt_min, dt_max):
        return ssd.ssd_scan_ref(x, dt, A_log, dt_bias, B, C, D, state(int(state_id), "delta"), position, float(dt_min),
                                float(dt_max))

    globals()["_LIB_STATE_SSD"] = define_op(
        NAMESPACE, STATE_SSD_OP, "Tensor x, Tensor dt, Tensor A_log, Tensor dt_bias, Tensor B, Tensor C, Tensor D, "
        "Tensor position, int state_id, float dt_min, float dt_max", "a", scan, lambda x, *rest: x.new_empty(x.shape))
    globals()["_LIB_STATE_CONV"] = define_op(
        NAMESPACE, STATE_CONV_OP, "Tensor x, Tensor weight, Tensor? bias, Tensor position, int state_id, "
        "int activation", "a", conv, lambda x, *rest: x.new_empty(x.shape))
    globals()["_LIB_STATE_DELTA"] = define_op(
        NAMESPACE, STATE_DELTA_OP, "Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, "
        "Tensor position, int state_id, float scale", "a", delta, lambda q, k, v, *rest: v.new_empty(v.shape))


STATE_CONV_OP, STATE_DELTA_OP, STATE_SSD_OP = "state_conv", "state_delta", "state_ssd"
if not hasattr(getattr(torch.ops, NAMESPACE), STATE_CONV_OP):
    _define_state_ops()


class RecurrentMixer(nn.Module):
    """A recurrent layer's token mixer. Its state is in buffers of its own (custom and static modes) or, given a
    `state_id`, in the runtime's off-graph cache; `_position` is set by `step_positions` for each call. Called outside
    a step (the HF model's own forward: smoothing's calibration, a reference), it runs the sequence from position 0
    on scratch state and leaves the state as it was."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], conv_dtype: torch.dtype, state_id: Optional[int]):
        super().__init__()
        # shapes: "conv" [K-1, C]; a DeltaNet's "delta" [Hv, Dk, Dv], a Mamba-2 layer's [H, N, P]
        self.shapes, self.state_id = shapes, state_id
        self.dtypes = {"conv": conv_dtype, "delta": torch.float32}
        if state_id is None:
            for name, shape in shapes.items():
                self.register_buffer(f"{name}_state", torch.zeros(shape, dtype=self.dtypes[name]), persistent=False)

    def _step(self) -> tuple[Optional[torch.Tensor], bool]:
        """(the step's positions or None outside a step, whether the state is the runtime's)."""
        pos = self.__dict__.get("_position")
        return pos, pos is not None and self.state_id is not None

    def _state(self, name: str, pos) -> torch.Tensor:
        return getattr(self, f"{name}_state") if pos is not None else \
            torch.zeros(self.shapes[name], dtype=self.dtypes[name])

    def run_conv(self, x, conv: nn.Module, activation: str) -> torch.Tensor:
        pos, runtime = self._step()
        weight, act = conv.weight.squeeze(1), ACTIVATIONS[activation]
        if runtime:
            return torch.ops.llmpipe.state_conv(x, weight, conv.bias, pos, self.state_id, act)
        position = pos if pos is not None else torch.arange(x.shape[1])
        return torch.ops.llmpipe.causal_conv(x, weight, conv.bias, self._state("conv", pos), position, act)

    def run_delta(self, q, k, v, a, b, A_log, dt_bias, scale: float) -> torch.Tensor:
        pos, runtime = self._step()
        if runtime:
            return torch.ops.llmpipe.state_delta(q, k, v, a, b, A_log, dt_bias, pos, self.state_id, scale)
        position = pos if pos is not None else torch.arange(q.shape[1])
        return torch.ops.llmpipe.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, self._state("delta", pos), position,
                                                  scale)

    def run_ssd(self, x, dt, A_log, dt_bias, B, C, D, dt_min: float, dt_max: float) -> torch.Tensor:
        pos, runtime = self._step()
        if runtime:
            return torch.ops.llmpipe.state_ssd(x, dt, A_log, dt_bias, B, C, D, pos, self.state_id, dt_min, dt_max)
        position = pos if pos is not None else torch.arange(x.shape[1])
        return torch.ops.llmpipe.ssd_scan(x, dt, A_log, dt_bias, B, C, D, self._state("delta", pos), position, dt_min,
                                          dt_max)

    def reset(self) -> None:
        for b in self.buffers(recurse=False):
            b.zero_()

    def state_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers(recurse=False))


class GatedDeltaMixer(RecurrentMixer):
    """Qwen3.5's linear attention: q|k|v -> causal conv (silu) -> gated delta rule; z gates the normed output."""

    def __init__(self, hf: nn.Module, spec: archs.GatedDeltaNet, config, dtype: torch.dtype,
                 state_id: Optional[int] = None):
        self.key_heads = getattr(config, spec.key_heads_key)
        self.value_heads = getattr(config, spec.value_heads_key)
        self.key_dim = getattr(config, spec.key_dim_key)
        self.value_dim = getattr(config, spec.value_dim_key)
        channels = 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
        super().__init__({"conv": (getattr(config, spec.kernel_key) - 1, channels),
                          "delta": (self.value_heads, self.key_dim, self.value_dim)}, dtype, state_id)
        self.names = (spec.qkv, spec.z, spec.b, spec.a, spec.out, spec.conv, spec.norm)
        for name in self.names:
            setattr(self, name, hf.get_submodule(name))
        self.A_log, self.dt_bias = hf.A_log, hf.dt_bias

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        qkv, z, b, a, out, conv, norm = (getattr(self, n) for n in self.names)
        T = hidden_states.shape[1]
        x = self.run_conv(qkv(hidden_states), conv, "silu")
        kd = self.key_heads * self.key_dim
        q = x[..., :kd].reshape(1, T, self.key_heads, self.key_dim)
        k = x[..., kd:2 * kd].reshape(1, T, self.key_heads, self.key_dim)
        v = x[..., 2 * kd:].reshape(1, T, self.value_heads, self.value_dim)
        core = self.run_delta(q, k, v, a(hidden_states), b(hidden_states), self.A_log.float(), self.dt_bias.float(),
                          self.key_dim ** -0.5)
        gated = norm(core.reshape(-1, self.value_dim), z(hidden_states).reshape(-1, self.value_dim))
        return out(gated.reshape(1, T, -1))


class ShortConvMixer(RecurrentMixer):
    """LFM2's short conv: in_proj -> B, C, x; y = C * conv(B * x); out_proj."""

    def __init__(self, hf: nn.Module, spec: archs.ShortConv, config, dtype: torch.dtype,
                 state_id: Optional[int] = None):
        conv = hf.get_submodule(spec.conv)
        super().__init__({"conv": (conv.kernel_size[0] - 1, conv.in_channels)}, dtype, state_id)
        self.names = (spec.in_proj, spec.out, spec.conv)
        for name in self.names:
            setattr(self, name, hf.get_submodule(name))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        in_proj, out, conv = (getattr(self, n) for n in self.names)
        B, C, x = in_proj(hidden_states).chunk(3, dim=-1)
        return out(C * self.run_conv(B * x, conv, "none"))


class Mamba2Mixer(RecurrentMixer):
    """A Mamba-2 layer: in_proj -> z | x,B,C | dt; x,B,C through the causal conv (silu); the SSD scan per head; the
    gated norm of y with z (HF's module: grouped, the gate before or after the norm); out_proj. The dims are the HF
    mixer's own attributes."""

    def __init__(self, hf: nn.Module, spec: archs.Mamba2, config, dtype: torch.dtype, state_id: Optional[int] = None):
        self.heads, self.head_dim, self.groups = hf.num_heads, hf.head_dim, hf.n_groups
        self.state_size, self.inner, self.conv_dim = hf.ssm_state_size, hf.intermediate_size, hf.conv_dim
        super().__init__({"conv": (hf.conv_kernel_size - 1, self.conv_dim),
                          "delta": (self.heads, self.state_size, self.head_dim)}, dtype, state_id)
        low, high = hf.time_step_limit or (0.0, float("inf"))
        self.dt_limits = (float(low), min(float(high), ssd.DT_MAX))
        self.names = (spec.in_proj, spec.conv, spec.norm, spec.out)
        for name in self.names:
            setattr(self, name, hf.get_submodule(name))
        self.A_log, self.dt_bias, self.D = hf.A_log, hf.dt_bias, hf.D
        # Falcon-H1: its input and projection multipliers (muP), and no norm unless mamba_rms_norm (y * silu(z))
        self.in_multiplier = float(getattr(hf, "ssm_in_multiplier", 1.0))
        self.mup_vector = getattr(hf, "mup_vector", None)
        self.normed = bool(getattr(hf, "mamba_rms_norm", True))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        in_proj, conv, norm, out = (getattr(self, n) for n in self.names)
        T, G, N = hidden_states.shape[1], self.groups, self.state_size
        if self.in_multiplier != 1.0:
            hidden_states = hidden_states * self.in_multiplier
        projected = in_proj(hidden_states)
        if self.mup_vector is not None:
            projected = projected * self.mup_vector
        z, xbc, dt = projected.split([self.inner, self.conv_dim, self.heads], dim=-1)
        x, B, C = self.run_conv(xbc, conv, "silu").split([self.inner, G * N, G * N], dim=-1)
        y = self.run_ssd(x.reshape(1, T, self.heads, self.head_dim), dt, self.A_log.float(), self.dt_bias.float(),
                         B.reshape(1, T, G, N), C.reshape(1, T, G, N), self.D.float(), *self.dt_limits)
        y = y.reshape(1, T, self.inner)
        return out(norm(y, z) if self.normed else y * F.silu(z))


def install_mixers(model: nn.Module, dtype: torch.dtype, runtime_state: bool = False) -> list[RecurrentMixer]:
    """Replace every recurrent layer's token mixer of an HF causal LM by ours: state buffers (the conv's in `dtype`,
    the delta rule's in fp32), or with `runtime_state` state ids 0, 1, ... into the off-graph cache. Returns them, in
    layer order."""
    arch = archs.of_model(model)
    config = model.config.get_text_config()
    mixers = []
    for layer, kind in zip(arch.decoder_layers(model), arch.layer_kinds(config)):
        if kind not in archs.STATE_KINDS:
            continue
        path = arch.mixer_path(kind)
        hf = layer.get_submodule(path)
        state_id = len(mixers) if runtime_state else None
        if kind == "linear_attention":
            mixer = GatedDeltaMixer(hf, arch.gated_delta, config, dtype, state_id)
        elif kind in ("mamba", "hybrid"):
            mixer = Mamba2Mixer(hf, arch.mamba2, config, dtype, state_id)
        else:
            mixer = ShortConvMixer(hf, arch.short_conv, config, dtype, state_id)
        setattr(layer, path, mixer)
        mixers.append(mixer)
    return mixers


def mixers(module: nn.Module) -> list[RecurrentMixer]:
    return [m for m in module.modules() if isinstance(m, RecurrentMixer)]


@contextlib.contextmanager
def step_positions(module: nn.Module, positions: torch.Tensor):
    """Hand the step's positions [T] to every recurrent mixer in `module` for the duration of one call."""
    found = mixers(module)
    for m in found:
        m.__dict__["_position"] = positions.reshape(-1)
    try:
        yield
    finally:
        for m in found:
            m.__dict__.pop("_position", None)


# get_layer_kinds codes: what each layer keeps from step to step
LAYER_KIND_CODES = {"flat": 0, "ring": 1, "linear_attention": 2, "conv": 3, "mamba": 4, "hybrid": 5, "mlp": 6}


def state_methods(text_config, rings: bool) -> dict:
    """The constant methods that publish a model's recurrent state ({} without recurrent layers): get_layer_kinds
    (per layer, LAYER_KIND_CODES) and get_state_shapes (per recurrent layer: the three dims of its matrix state, a
    Gated DeltaNet's value heads, key dim, value dim or a Mamba-2 layer's heads, state size, head dim; 0 0 0 for a
    short conv; then its conv state's rows and channels)."""
    from pipeline.model.geometry import from_config
    g = from_config(text_config)
    if not g.recurrent:
        return {}
    kinds, shapes = [], []
    for i in range(g.num_layers):
        kind = g.kind(i)
        if kind in archs.STATE_KINDS:
            s = g.state_shapes(i)
            shapes += [*s.get("delta", (0, 0, 0)), *s["conv"]]
        elif kind in archs.MLP_KINDS:
            kind = "mlp"
        else:
            kind = "ring" if rings and kind == "sliding_attention" else "flat"
        kinds.append(LAYER_KIND_CODES[kind])
    return {"get_layer_kinds": torch.tensor(kinds, dtype=torch.long),
            "get_state_shapes": torch.tensor(shapes, dtype=torch.long)}
