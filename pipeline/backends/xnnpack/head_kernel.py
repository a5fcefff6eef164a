"""backend.lm_head_kernel=llmpipe: the lm_head's 8da4w GEMM outside the XNNPACK delegate, on llmpipe::linear_q4.

Why: at decode's one row the lm_head is most of a token's bytes (gemma3: 262,144 x 640 weights, 94 of ~150 MB), and
XNNPACK's qd8-f32-qb4w kernel streams it at ~11 GB/s a thread (gemma's head: 8.6 ms at 1 thread, 4.6 ms at 2);
native/src/kernels/qb4w.cpp, one 64-byte load per 128 weights, streams it about twice as fast. It computes XNNPACK's
numerics bit for bit (qdu8 activations, exact group dots, one fma per group in order: numerics.py), so the program
equals the same-quantization reference as before, and verify's exact figures stay exact.

    llmpipe::linear_q4(x [..., K] fp32, w4 [N/16, K/8, 64] u8, scales [N/16, K/group, 16] bf16, ksum [N] fp32,
                       group) -> [..., N] fp32

The swap is made on the module export traces (prepare), so the quantize stage's module, and verify's reference
built from it, keep the torchao linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.backends.xnnpack import numerics
from pipeline.model.attention import define_op

NAMESPACE, OP_NAME = "llmpipe", "linear_q4"
QUALNAME = f"{NAMESPACE}::{OP_NAME}"


def unpack_nibbles(w4: torch.Tensor) -> torch.Tensor:
    """numerics.pack_nibbles undone: int4 weights [N][K] as int8."""
    blocks, chunks = w4.shape[0], w4.shape[1]
    u = torch.stack([w4 & 0x0F, w4 >> 4], dim=2).reshape(blocks, chunks, 2, 16, 4)   # [b][c][half][col][j]
    return (u.permute(0, 3, 1, 2, 4).reshape(blocks * 16, chunks * 8).to(torch.int16) - 8).to(torch.int8)


def linear_q4(x: torch.Tensor, w4: torch.Tensor, scales: torch.Tensor, ksum: torch.Tensor, group: int) -> torch.Tensor:
    """The op's eager form: numerics' XNNPACK steps (qdu8 activations) from the packed buffers."""
    k, cols = x.shape[-1], ksum.shape[0]
    x2 = x.reshape(-1, k).float()
    mult, dq, zp = numerics.row_qparams(x2, unsigned=True)
    a = numerics.quantize_rows(x2, mult, zp, unsigned=True)
    out = ksum[None, :] * zp.float()[:, None]                    # the running sum starts at ksum * zp
    native = numerics._native_qb4w()
    if native is not None:
        a8 = a.to(torch.uint8).contiguous()
        if native(a8.data_ptr(), a8.shape[0], k, w4.contiguous().data_ptr(), cols, group,
                  scales.contiguous().data_ptr(), out.data_ptr()) != 0:
            raise RuntimeError(f"{QUALNAME}: llmpipe_qb4w_gemm refused its arguments")
    else:
        groups = k // group
        sum_dtype = torch.float32 if numerics.dots_exact_in_fp32(group) else torch.float64
        w16 = (unpack_nibbles(w4).to(sum_dtype) * 16).reshape(cols, groups, group).permute(1, 2, 0)
        acc = torch.bmm(a.to(sum_dtype).reshape(-1, groups, group).transpose(0, 1), w16).float()
        out = numerics.fma32_chain(acc, scales.float().transpose(0, 1).reshape(groups, cols), out)
    return (out * dq[:, None]).reshape(*x.shape[:-1], cols)


def _fake(x, w4, scales, ksum, group):
    return x.new_empty((*x.shape[:-1], ksum.shape[0]), dtype=torch.float32)


if not hasattr(torch.ops, NAMESPACE) or not hasattr(getattr(torch.ops, NAMESPACE), OP_NAME):
    _LIB = define_op(NAMESPACE, OP_NAME, "Tensor x, Tensor w4, Tensor scales, Tensor ksum, int group", "a",
                     linear_q4, _fake)


class Q4Linear(nn.Module):
    """A torchao 8da4w linear as llmpipe::linear_q4 computes it (no bias; N a multiple of 16)."""

    def __init__(self, w4: torch.Tensor, scales: torch.Tensor, ksum: torch.Tensor, group: int):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = w4.shape[1] * 8, ksum.shape[0]
        self.register_buffer("w4", w4)
        self.register_buffer("scales", scales)
        self.register_buffer("ksum", ksum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmpipe.linear_q4(x, self.w4, self.scales, self.ksum, self.group)


def why_not(m: nn.Module) -> str | None:
    """Why llmpipe::linear_q4 cannot take this linear (None: it can)."""
    w = numerics.dynamic_weight(m)
    if w is None or w.target_dtype != torch.int4:
        return "it is not an 8da4w linear"
    if m.bias is not None:
        return "it has a bias"
    n, k = w.qdata.shape
    group = k // w.scale.reshape(n, -1).shape[1]
    if n % 16 or group % numerics.KSUM_CHUNK or k % group:
        return f"its shape ({n} x {k}, group {group}) is not N % 16 == 0 with groups of a multiple of 16"
    if w.zero_point is not None and bool((w.zero_point != 0).any()):
        return "its weights are asymmetric"
    return None


def q4_linear(m: nn.Linear) -> Q4Linear:
    """The packed form of a torchao 8da4w linear (why_not(m) is None)."""
    w = numerics.dynamic_weight(m)
    n, k = w.qdata.shape
    scale = numerics.bf16(w.scale.reshape(n, -1).float())        # ExecuTorch serializes the scales as bf16
    group = k // scale.shape[1]
    scale16 = numerics.bf16(scale / 16).T.contiguous()
    w4 = numerics.pack_nibbles(w.qdata.to(torch.int8)).reshape(n // 16, k // 8, 64)
    return Q4Linear(w4, numerics.block_scales(scale16),
                    numerics.packed_ksum(w.qdata, scale, group), group)


def swap_head(model: nn.Module) -> dict:
    """The model's lm_head as llmpipe::linear_q4; raises ValueError naming why it cannot be."""
    head = model.get_output_embeddings()
    why = why_not(head)
    if why is not None:
        raise ValueError(f"backend.lm_head_kernel=llmpipe: the lm_head cannot run on {QUALNAME}: {why}")
    model.set_output_embeddings(q4_linear(head))
    return {"lm_head_kernel": "llmpipe", "lm_head_shape": [head.out_features, head.in_features]}
