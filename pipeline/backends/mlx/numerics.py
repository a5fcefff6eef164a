"""What an MLX program computes at half precision, in torch: verify's same-quantization reference for fp16 / bf16
weight-only builds.

ExecuTorch's MLX backend rewrites torchao's `s * (q - z)` as MLX's affine form `S * Q + B` with Q = q + 2^(bits-1)
and B = -s * (z + 2^(bits-1)) computed in the scale's dtype (executorch/backends/mlx/builder/op_helpers.py
`to_mlx_qparams`): at bf16, B is rounded to 8 bits of mantissa, so about half of the dequantized weights differ from
torchao's by a bf16 step. MLX's quantized matmul kernels on Apple GPUs accumulate in fp32; the interpreter here
does the same (pipeline/runtimes/mlx/ops.py). So the reference computes each half-precision weight-only linear as
fp32 x (S * Q + B in fp32) with that rounded B, and rounds the output to the half type once. At fp32 nothing is
rounded: torchao's module is the reference as it is.
"""
from __future__ import annotations

import copy

import torch
from torch import nn


def weight_only(m: nn.Module):
    """The torchao weight of a weight-only quantized linear, or None."""
    w = getattr(m, "weight", None)
    if not isinstance(m, nn.Linear) or not all(hasattr(w, a) for a in ("qdata", "scale", "zero_point", "block_size")):
        return None
    return w if getattr(w, "activation_quantization", None) is None else None


class MlxAffineLinear(nn.Module):
    """y = half(x32 @ (S * Q + B)32^T + bias), B rounded to the half type as ExecuTorch serializes it."""

    def __init__(self, m: nn.Linear):
        super().__init__()
        w = weight_only(m)
        bits = 4 if w.target_dtype in (torch.int4, getattr(torch, "int4", None)) else 8
        offset = 2 ** (bits - 1)
        group = w.block_size[1]
        scale, zero = w.scale, w.zero_point
        biases = -scale * (zero.to(scale.dtype) + offset)   # in the scale's dtype, as the serializer does
        q = (w.qdata.to(torch.int32) + offset).float()
        s32 = scale.float().repeat_interleave(group, 1)
        b32 = biases.float().repeat_interleave(group, 1)
        self.register_buffer("weight32", s32 * q + b32)
        self.register_buffer("bias32", None if m.bias is None else m.bias.float())
        self.out_dtype = scale.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.float(), self.weight32, self.bias32).to(x.dtype)


def reference(module: nn.Module, dtype: torch.dtype, copy_first: bool = True) -> nn.Module:
    """The module itself at fp32; at half precision its weight-only linears computing as MLX's do, in a deep copy or
    (copy_first=False) in the module itself."""
    if dtype == torch.float32 or not any(weight_only(m) is not None for m in module.modules()):
        return module
    ref = copy.deepcopy(module) if copy_first else module
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if weight_only(child) is not None:
                setattr(parent, name, MlxAffineLinear(child))
    return ref
