"""Mamba-2's state-space scan (the SSD layers of Bamba, Granite-4.0-H, Nemotron-H, Falcon-H1) as one op over a
recurrent state, and its Python twin. The C++ kernel is native/src/kernels/ssd_kernel.cpp.

    llmpipe::ssd_scan(x, dt, A_log, dt_bias, B, C, D, state!, position, dt_min, dt_max) -> out

- x [1,T,H,P] (the conv's output split per head); dt [1,T,H] (in_proj's time-step rows, before the bias);
  A_log, dt_bias, D [H]; B, C [1,T,G,N] with H % G == 0 (head h reads group h // (H / G)).
- state [H,N,P] fp32, whatever the activations' dtype, updated in place; zeroed first when position[0] == 0, so a
  step at 0 starts a new sequence (as a step at 0 overwrites the K/V cache).
- out [1,T,H,P] in x's dtype.

The math is HF's (mamba2_chunk_scan / selective_state_update): delta = clamp(softplus(dt + dt_bias), dt_min, dt_max),
a = -exp(A_log) * delta (the log decay, <= 0). Per token:
    S <- exp(a) S + B (delta x)^T,   y = S^T C + D x
It is the gated delta rule (gated_delta.py) without the delta correction: the state is [H, N, P], the key B, the
value delta x, the query C. A step of T tokens runs in the chunked form: within a chunk, with gamma the cumulative log
decay and u_j = delta_j x_j,
    y_i = exp(gamma_i) S^T C_i + sum_{j<=i} exp(gamma_i - gamma_j) (C_i.B_j) u_j + D x_i
    S  <- exp(gamma_n) S + sum_j exp(gamma_n - gamma_j) B_j u_j^T
Every exponent is <= 0. The twin computes in float64 and rounds the state and the output once per step; the kernel
computes in fp32.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from pipeline.model.layers.attention import define_op
from pipeline.model.layers.gated_delta import step_start

NAMESPACE = "llmpipe"
OP_NAME = "ssd_scan"
QUALNAME = f"{NAMESPACE}::{OP_NAME}"
CHUNK = 64        # tokens per chunk of the chunked form; the kernel uses the same
DT_MAX = 3.4e38   # HF's default upper limit is inf: the program carries fp32's largest instead


def deltas(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float, dtype=torch.float64):
    """delta [T,H]: the time step each head takes at each token (softplus as torch's: x itself above 20)."""
    return F.softplus(dt[0].to(dtype) + dt_bias.to(dtype)).clamp(dt_min, dt_max)


def check_step(x, dt, A_log, dt_bias, B, C, D, state, position) -> tuple[int, int]:
    """Shapes of one step (see the module docstring); returns (pos, T)."""
    if x.dim() != 4 or x.shape[0] != 1 or B.dim() != 4 or B.shape != C.shape or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"{QUALNAME}: x must be [1,T,H,P] and B, C [1,T,G,N], got {tuple(x.shape)}, "
                         f"{tuple(B.shape)}, {tuple(C.shape)}")
    T, H, P = x.shape[1:]
    G, N = B.shape[2:]
    if H % G:
        raise ValueError(f"{QUALNAME}: {H} heads are not a multiple of {G} groups")
    if dt.shape != (1, T, H) or any(p.shape != (H,) for p in (A_log, dt_bias, D)):
        raise ValueError(f"{QUALNAME}: dt must be [1,{T},{H}] and A_log, dt_bias, D [{H}], got {tuple(dt.shape)}, "
                         f"{tuple(A_log.shape)}, {tuple(dt_bias.shape)}, {tuple(D.shape)}")
    if state.shape != (H, N, P) or state.dtype != torch.float32:
        raise ValueError(f"{QUALNAME}: state must be fp32 [{H},{N},{P}], got {state.dtype} {tuple(state.shape)}")
    return step_start(QUALNAME, position, T), T


def _per_head(x, dt, A_log, dt_bias, B, C, dt_min, dt_max):
    """(X, U, Bh, Ch, a) per head in float64: x [H,T,P], delta x [H,T,P], B and C [H,T,N], the log decay [H,T]."""
    H = x.shape[2]
    group = H // B.shape[2]
    delta = deltas(dt, dt_bias, dt_min, dt_max).transpose(0, 1)               # [H,T]
    X = x[0].to(torch.float64).transpose(0, 1)
    Bh = B[0].to(torch.float64).repeat_interleave(group, 1).transpose(0, 1)
    Ch = C[0].to(torch.float64).repeat_interleave(group, 1).transpose(0, 1)
    a = -torch.exp(A_log.to(torch.float64))[:, None] * delta
    return X, delta[..., None] * X, Bh, Ch, a


def ssd_scan_ref(x, dt, A_log, dt_bias, B, C, D, state, position, dt_min: float = 0.0, dt_max: float = DT_MAX,
                 chunk: int = CHUNK) -> torch.Tensor:
    """Reference semantics (eager): advance `state` in place over the step's tokens, chunk by chunk; return out."""
    pos, T = check_step(x, dt, A_log, dt_bias, B, C, D, state, position)
    if pos == 0:
        state.zero_()
    X, U, Bh, Ch, a = _per_head(x, dt, A_log, dt_bias, B, C, dt_min, dt_max)
    S = state.to(torch.float64)
    out = D.to(torch.float64)[:, None, None] * X
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        gamma = a[:, c0:c1].cumsum(-1)                                           # [H,n]
        n = c1 - c0
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        Cc, Bc, Uc = Ch[:, c0:c1], Bh[:, c0:c1], U[:, c0:c1]
        out[:, c0:c1] += gamma.exp()[..., None] * (Cc @ S) + ((Cc @ Bc.transpose(1, 2)) * decay) @ Uc
        last = gamma[:, -1:]
        S = last.exp()[..., None] * S + ((last - gamma).exp()[..., None] * Bc).transpose(1, 2) @ Uc
    state.copy_(S)
    return out.transpose(0, 1).unsqueeze(0).to(x.dtype)


def ssd_scan_steps(x, dt, A_log, dt_bias, B, C, D, state, position, dt_min: float = 0.0,
                   dt_max: float = DT_MAX) -> torch.Tensor:
    """The same scan one token at a time (the recurrent form), in float64: what the chunked form must equal."""
    pos, T = check_step(x, dt, A_log, dt_bias, B, C, D, state, position)
    if pos == 0:
        state.zero_()
    X, U, Bh, Ch, a = _per_head(x, dt, A_log, dt_bias, B, C, dt_min, dt_max)
    S = state.to(torch.float64)
    out = []
    for t in range(T):
        S = S * a[:, t].exp()[:, None, None] + Bh[:, t, :, None] * U[:, t, None, :]
        out.append(torch.einsum("hnp,hn->hp", S, Ch[:, t]) + D.to(torch.float64)[:, None] * X[:, t])
    state.copy_(S)
    return torch.stack(out).unsqueeze(0).to(x.dtype)


def _define() -> None:
    def eager(x, dt, A_log, dt_bias, B, C, D, state, position, dt_min, dt_max):
        return ssd_scan_ref(x, dt, A_log, dt_bias, B, C, D, state, position, float(dt_min), float(dt_max))

    def fake(x, *rest):
        return x.new_empty(x.shape)

    globals()["_LIB"] = define_op(
        NAMESPACE, OP_NAME, "Tensor x, Tensor dt, Tensor A_log, Tensor dt_bias, Tensor B, Tensor C, Tensor D, "
        "Tensor(a!) state, Tensor position, float dt_min, float dt_max", "b", eager, fake)


if not hasattr(getattr(torch.ops, NAMESPACE), OP_NAME):
    _define()
