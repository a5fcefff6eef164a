"""The recurrent layers' ops the MLX delegate lowers, switched into the wrapped module's mixers before torch.export
(pipeline/model/layers/recurrent.py's RecurrentMixer: run_conv, run_delta). An MLX program is delegate calls only, so
the state is always the program's buffers: in `custom` and `static` as on XNNPACK, and in `offgraph` too, beside the
runtime's K/V (the MLX runtime runs no op of ours that could reach a runtime-owned state).

- the conv: the state's K-1 rows, then the step's rows, through a depthwise conv1d (the delegate's Conv1DNode); the
  last K-1 rows are written back;
- the gated delta rule: mlx::gated_delta_rule (the delegate's recurrence over the step: its Metal kernel where the
  key dim is a multiple of 32, else a ScanNode), over a state laid out [1, value heads, value dim, key dim] (the
  op's); q and k l2-normed first (as rms_norm with the eps scaled: x / sqrt(|x|^2 + e) = rms_norm(x, e / D) /
  sqrt(D)), the decay exp(-exp(A_log) softplus(a + dt_bias)) and beta = sigmoid(b) computed in the graph;
- Mamba-2's scan: the step as one chunk of ssd.py's chunked form in plain ops (cumsum, exp, matmuls, a causal mask
  from aranges), over a state [heads, state size, head dim]: quadratic in the step's length, which a prefill chunk
  bounds;
- a step at position 0 starts over: the state is multiplied by (position != 0) first, in place.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from pipeline.model.layers import recurrent


def _keep(pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (pos.reshape(-1)[0] != 0).to(dtype)


def mlx_conv(mixer: recurrent.RecurrentMixer, x: torch.Tensor, conv: nn.Module, activation: str) -> torch.Tensor:
    """x [1, T, C] -> [1, T, C] over the conv state [K-1, C]."""
    pos, _ = mixer._step()
    if pos is None:  # HF's own forward (calibration, a reference): the eager path, scratch state
        return recurrent.RecurrentMixer.run_conv(mixer, x, conv, activation)
    state = mixer.conv_state
    state.mul_(_keep(pos, state.dtype))
    rows = torch.cat([state.unsqueeze(0), x.to(state.dtype)], dim=1)  # [1, K-1+T, C]
    held = state.shape[0]
    state.copy_(rows[0, rows.shape[1] - held:])
    y = F.conv1d(rows.transpose(1, 2), conv.weight, conv.bias, groups=rows.shape[2]).transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    d = x.shape[-1]
    return F.rms_norm(x, (d,), eps=eps / d) / math.sqrt(d)


def mlx_delta(mixer: recurrent.RecurrentMixer, q, k, v, a, b, A_log, dt_bias, scale: float) -> torch.Tensor:
    """q, k [1, T, Hk, Dk], v [1, T, Hv, Dv], a, b [1, T, Hv] -> [1, T, Hv, Dv] over the state [1, Hv, Dv, Dk]."""
    pos, _ = mixer._step()
    if pos is None:
        return recurrent.RecurrentMixer.run_delta(mixer, q, k, v, a, b, A_log, dt_bias, scale)
    state = mixer.delta_state
    state.mul_(_keep(pos, state.dtype))
    x = a.float() + dt_bias
    g = torch.exp(-torch.exp(A_log) * torch.logaddexp(x, torch.zeros_like(x)))
    return torch.ops.mlx.gated_delta_rule(_l2norm(q.float()) * scale, _l2norm(k.float()), v.float(), g,
                                          torch.sigmoid(b.float()), state, use_custom_kernel=q.shape[-1] % 32 == 0)


def mlx_ssd(mixer: recurrent.RecurrentMixer, x, dt, A_log, dt_bias, B, C, D, dt_min: float,
            dt_max: float) -> torch.Tensor:
    """x [1, T, H, P], dt [1, T, H], B, C [1, T, G, N] -> [1, T, H, P] over the state [H, N, P]."""
    pos, _ = mixer._step()
    if pos is None:
        return recurrent.RecurrentMixer.run_ssd(mixer, x, dt, A_log, dt_bias, B, C, D, dt_min, dt_max)
    state = mixer.delta_state
    state.mul_(_keep(pos, state.dtype))
    T, H = x.shape[1], x.shape[2]
    group = H // B.shape[2]
    d = dt[0].float() + dt_bias
    delta = torch.logaddexp(d, torch.zeros_like(d)).clamp(dt_min, dt_max).transpose(0, 1)    # [H, T]
    gamma = torch.cumsum(-torch.exp(A_log)[:, None] * delta, dim=-1)                          # [H, T], <= 0
    X = x[0].float().transpose(0, 1)                                                          # [H, T, P]
    Bh = B[0].float().repeat_interleave(group, dim=1).transpose(0, 1)                         # [H, T, N]
    Ch = C[0].float().repeat_interleave(group, dim=1).transpose(0, 1)
    U = delta[..., None] * X
    idx = torch.arange(T)
    causal = (idx[:, None] >= idx[None, :]).float()
    # exponents above the diagonal would be >= 0: clamped to 0 there, then masked out
    decay = torch.exp(torch.clamp(gamma[:, :, None] - gamma[:, None, :], max=0.0)) * causal   # [H, T, T]
    y = torch.exp(gamma)[..., None] * (Ch @ state) + ((Ch @ Bh.transpose(1, 2)) * decay) @ U + D[:, None, None] * X
    last = gamma[:, T - 1:]
    state.copy_(torch.exp(last)[..., None] * state + (torch.exp(last - gamma)[..., None] * Bh).transpose(1, 2) @ U)
    return y.transpose(0, 1).unsqueeze(0).to(x.dtype)


def install_mlx_forms(mixer: recurrent.RecurrentMixer) -> None:
    """Bind a mixer's run_conv / run_delta / run_ssd to the MLX forms, its state in buffers (the delta rule's in
    the op's layout)."""
    mixer.state_id = None  # the program holds the state (see the module's docstring)
    mamba = isinstance(mixer, recurrent.Mamba2Mixer)
    for name, shape in mixer.shapes.items():
        if name == "delta" and not mamba:  # the op's layout: [1, Hv, Dv, Dk]
            shape = (1, shape[0], shape[2], shape[1])
        mixer.register_buffer(f"{name}_state", torch.zeros(shape, dtype=mixer.dtypes[name]), persistent=False)
    mixer.run_conv = lambda x, conv, activation: mlx_conv(mixer, x, conv, activation)
    mixer.run_delta = lambda *args: mlx_delta(mixer, *args)
    mixer.run_ssd = lambda *args: mlx_ssd(mixer, *args)


def prepare_recurrent(module: nn.Module) -> dict:
    """Switch every recurrent mixer of a wrapped module to the MLX forms; returns a report."""
    found = recurrent.mixers(module)
    if not found:
        return {}
    import executorch.backends.mlx.custom_kernel_ops.gated_delta_rule  # noqa: F401  (registers mlx::gated_delta_rule)
    for m in found:
        install_mlx_forms(m)
    return {"recurrent": f"{len(found)} mixers: conv1d + mlx::gated_delta_rule or the SSD scan's plain ops, state in "
                         "the program's buffers"}
