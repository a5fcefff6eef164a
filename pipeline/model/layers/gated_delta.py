"""The gated delta rule (Qwen3.5 / Qwen3-Next linear-attention layers) as one op over a recurrent state, and its
Python twin. The C++ kernel is native/src/kernels/gated_delta_kernel.cpp.

    llmpipe::gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state!, position, scale) -> out

- q, k [1,T,Hk,Dk] (after the short conv, before normalization); v [1,T,Hv,Dv]; a, b [1,T,Hv] (the in_proj_a / in_proj_b
  outputs); A_log, dt_bias [Hv]; Hv % Hk == 0 (value head h reads key head h // (Hv / Hk)).
- state [Hv,Dk,Dv] fp32, whatever the activations' dtype, updated in place; zeroed first when position[0] == 0, so a
  step at 0 starts a new sequence (as a step at 0 overwrites the K/V cache).
- out [1,T,Hv,Dv] in v's dtype.

The math is HF's (transformers' torch_chunk_gated_delta_rule with use_qk_l2norm_in_kernel): q and k l2-normalized
(eps 1e-6 under the root), q times `scale`; beta = sigmoid(b); the log decay g = -exp(A_log) * softplus(a + dt_bias).
Per token: S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q.

A step of T tokens runs in the chunked form (chunks of CHUNK tokens), not as T single steps: within a chunk, with
gamma the cumulative log decay and L[i,j] = beta_i exp(gamma_i - gamma_j) k_i.k_j (j < i),
    (I + L) U = beta V,   (I + L) W = beta exp(gamma) K,   u = U - W S
    o_i = exp(gamma_i) S^T q_i + sum_{j<=i} exp(gamma_i - gamma_j) (q_i.k_j) u_j
    S  <- exp(gamma_n) S + sum_j exp(gamma_n - gamma_j) k_j u_j^T
Every exponent is <= 0, so nothing overflows however strong the decay. The twin computes in float64 and rounds the
state and the output to their dtypes once per step; the kernel computes in fp32.
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from pipeline.model.layers.attention import define_op

NAMESPACE = "llmpipe"
OP_NAME = "gated_delta_rule"
QUALNAME = f"{NAMESPACE}::{OP_NAME}"
CHUNK = 64        # tokens per chunk of the chunked form (HF's); the kernel uses the same
L2_EPS = 1e-6     # HF's l2norm: x * rsqrt(sum(x^2) + eps)


def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
          dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) [T,Hv] from the projections a, b [1,T,Hv]: the log decay (<= 0) and the write strength."""
    g = -torch.exp(A_log.to(dtype)) * F.softplus(a[0].to(dtype) + dt_bias.to(dtype))
    return g, torch.sigmoid(b[0].to(dtype))


def normalized(x: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    x = x.to(dtype)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def check_step(q, k, v, a, b, A_log, dt_bias, state, position) -> tuple[int, int]:
    """Shapes of one step (see the module docstring); returns (pos, T)."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or q.shape[0] != 1 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"{QUALNAME}: q, k must be [1,T,Hk,Dk] and v [1,T,Hv,Dv], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    T, Hk, Dk = q.shape[1:]
    Hv, Dv = v.shape[2:]
    if Hv % Hk:
        raise ValueError(f"{QUALNAME}: {Hv} value heads are not a multiple of {Hk} key heads")
    if a.shape != (1, T, Hv) or b.shape != (1, T, Hv) or A_log.shape != (Hv,) or dt_bias.shape != (Hv,):
        raise ValueError(f"{QUALNAME}: a, b must be [1,{T},{Hv}] and A_log, dt_bias [{Hv}], got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}, {tuple(A_log.shape)}, {tuple(dt_bias.shape)}")
    if state.shape != (Hv, Dk, Dv) or state.dtype != torch.float32:
        raise ValueError(f"{QUALNAME}: state must be fp32 [{Hv},{Dk},{Dv}], got {state.dtype} {tuple(state.shape)}")
    return step_start(QUALNAME, position, T), T


def step_start(op: str, position: torch.Tensor, T: int) -> int:
    """The first of a recurrent op's step positions, which must be T consecutive entries from >= 0."""
    pos_list = position.reshape(-1).tolist()
    if len(pos_list) != T or pos_list != list(range(pos_list[0], pos_list[0] + T)) or pos_list[0] < 0:
        raise ValueError(f"{op}: position must be {T} consecutive entries from >= 0, got {pos_list}")
    return int(pos_list[0])


def gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, state, position, scale: float,
                         chunk: int = CHUNK) -> torch.Tensor:
    """Reference semantics (eager): advance `state` in place over the step's tokens, chunk by chunk; return out."""
    pos, T = check_step(q, k, v, a, b, A_log, dt_bias, state, position)
    if pos == 0:
        state.zero_()
    Hv = v.shape[2]
    group = Hv // q.shape[2]
    Q = (normalized(q[0]) * scale).repeat_interleave(group, 1).transpose(0, 1)  # [Hv,T,Dk]
    K = normalized(k[0]).repeat_interleave(group, 1).transpose(0, 1)
    V = v[0].to(torch.float64).transpose(0, 1)                                  # [Hv,T,Dv]
    g, beta = (x.transpose(0, 1) for x in gates(a, b, A_log, dt_bias))          # [Hv,T]
    S = state.to(torch.float64)
    out = torch.empty_like(V)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        Qc, Kc, Vc, bc = Q[:, c0:c1], K[:, c0:c1], V[:, c0:c1], beta[:, c0:c1, None]
        gamma = g[:, c0:c1].cumsum(-1)                                           # [Hv,n]
        n = c1 - c0
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [Hv,n,n]
        L = (bc * (Kc @ Kc.transpose(1, 2)) * decay).tril(-1)
        eye = torch.eye(n, dtype=torch.float64).expand_as(L)
        U = torch.linalg.solve_triangular(eye + L, bc * Vc, upper=False, unitriangular=True)
        W = torch.linalg.solve_triangular(eye + L, bc * gamma.exp()[..., None] * Kc, upper=False,
                                          unitriangular=True)
        u = U - W @ S                                                            # [Hv,n,Dv]
        out[:, c0:c1] = gamma.exp()[..., None] * (Qc @ S) + ((Qc @ Kc.transpose(1, 2)) * decay) @ u
        last = gamma[:, -1:]
        S = last.exp()[..., None] * S + ((last - gamma).exp()[..., None] * Kc).transpose(1, 2) @ u
    state.copy_(S)
    return out.transpose(0, 1).unsqueeze(0).to(v.dtype)


def gated_delta_rule_steps(q, k, v, a, b, A_log, dt_bias, state, position, scale: float) -> torch.Tensor:
    """The same rule one token at a time (the recurrent form), in float64: what the chunked form must equal."""
    pos, T = check_step(q, k, v, a, b, A_log, dt_bias, state, position)
    if pos == 0:
        state.zero_()
    group = v.shape[2] // q.shape[2]
    Q = (normalized(q[0]) * scale).repeat_interleave(group, 1)                  # [T,Hv,Dk]
    K = normalized(k[0]).repeat_interleave(group, 1)
    g, beta = gates(a, b, A_log, dt_bias)
    S = state.to(torch.float64)
    out = []
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[0, t].to(torch.float64) - torch.einsum("hdv,hd->hv", S, K[t]))
        S = S + K[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hdv,hd->hv", S, Q[t]))
    state.copy_(S)
    return torch.stack(out).unsqueeze(0).to(v.dtype)


def _define() -> None:
    def eager(q, k, v, a, b, A_log, dt_bias, state, position, scale):
        return gated_delta_rule_ref(q, k, v, a, b, A_log, dt_bias, state, position, float(scale))

    def fake(q, k, v, a, b, A_log, dt_bias, state, position, scale):
        return v.new_empty(v.shape)

    globals()["_LIB"] = define_op(
        NAMESPACE, OP_NAME, "Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor A_log, Tensor dt_bias, "
        "Tensor(a!) state, Tensor position, float scale", "b", eager, fake)


if not hasattr(getattr(torch.ops, NAMESPACE), OP_NAME):
    _define()
