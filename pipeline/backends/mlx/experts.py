"""A MoE layer's experts as the MLX delegate runs them: per projection, one gather matmul over the experts' stacked
weights (mlx::gather_mm, or mlx::gather_qmm for torchao's 4-bit / 8-bit weights, which the delegate repacks to MLX's
affine format), indexed by each token's chosen experts, one top-k slot at a time: a token reads only its top-k."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pipeline.model import archs
from pipeline.model.layers.experts import ExpertBank, pack4, replace_banks


class GatherProjection(nn.Module):
    """One projection of every expert: fp32 weights [E, in, out] (gather_mm), or torchao's quantized values (4-bit
    ones two a byte) with their scales and zero points [E, out, ...] (gather_qmm)."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        w0 = linears[0].weight
        self.quantized = hasattr(w0, "qdata")
        if self.quantized:
            ws = [m.weight for m in linears]
            self.bits, self.group = (4 if w0.target_dtype == torch.int4 else 8), int(w0.block_size[-1])
            q = torch.stack([w.qdata for w in ws])
            self.register_buffer("qdata", pack4(q) if self.bits == 4 else q)
            self.register_buffer("scale", torch.stack([w.scale for w in ws]))
            self.register_buffer("zero_point", torch.stack([w.zero_point for w in ws]))
        else:
            self.register_buffer("weight", torch.stack([m.weight.detach() for m in linears]).transpose(1, 2).contiguous())

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [N, 1, in], idx [N] -> [N, 1, out]"""
        if self.quantized:
            return torch.ops.mlx.gather_qmm(x, self.qdata, self.scale, biases=self.zero_point, rhs_indices=idx,
                                            transpose=True, group_size=self.group, bits=self.bits)
        return torch.ops.mlx.gather_mm(x, self.weight, rhs_indices=idx)


class GatherExperts(nn.Module):
    """forward(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H], as an ExpertBank computes it."""

    def __init__(self, bank: ExpertBank):
        super().__init__()
        self.ungated = bank[0].activation in archs.UNGATED_ACTIVATIONS
        for role, name in archs.expert_linears(bank[0].activation).items():
            setattr(self, role, GatherProjection([getattr(x, name) for x in bank]))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden.unsqueeze(-2)
        out = torch.zeros_like(hidden)
        for k in range(top_k_index.shape[-1]):
            idx = top_k_index[:, k]
            up = self.up(x, idx)
            a = torch.square(F.relu(up)) if self.ungated else F.silu(self.gate(x, idx)) * up
            out = out + self.down(a, idx).squeeze(-2) * top_k_weights[:, k:k + 1].to(hidden.dtype)
        return out


def gather_experts(model: nn.Module) -> int:
    """Every ExpertBank as GatherExperts (before torch.export); returns how many."""
    return replace_banks(model, GatherExperts)
