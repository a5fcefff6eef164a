"""K/V storage rows, as the C++ caches keep them (native/src/kernels/kv_attention.h): float rows of the storage
dtype, or quantized rows that carry their own scales.

A quantized row of n values holds them in groups of 32 (the last may be shorter), each group symmetric with a scale.
The scales come first, the last group's first, so the C++ reader finds a group's scale from the values' address; then
the values. A row is self-contained: wherever it moves (a ring slot, a batched cell, a prefix snapshot) its scales go
with it. The rounding is the C++ quantize_row's (kernels/kv_rows.h), bit for bit.
- int8 (torch.int8 buffers): an fp32 scale a group, max |x| / 127; values round half to even of x / scale.
  Groups of 32 rather than one scale a row: SmolLM2's keys have outlier channels, and a row's scale set by them rounds
  the rest coarsely (groups of 32 halved the KLD against fp32 K/V, measured eagerly on three held-out domains).
- int4 (torch.uint8 buffers): the row rotated first (hadamard below), then an fp16 scale a group: the group's value
  of largest magnitude / -8 (as llama.cpp's q4_0: it lands on -8 and all 16 levels are used; max |x| / 7 leaves -8
  unused and cost SmolLM2 0.053 KLD against 0.041, eagerly over three held-out domains); values in [-8, 7] stored + 8,
  two a byte (element 2i the low nibble). The rotation spreads an outlier channel over the whole head, so no group's
  16 levels are spent on one value. Attention computes in the rotated basis (the C++ core rotates each query on entry
  and each output back; the rotation is orthonormal and its own inverse), which keeps the projections as the
  checkpoint has them: a rotation folded into W_k would not commute with RoPE.
"""
from __future__ import annotations

import torch

GROUP = 32
INT4 = torch.uint8  # no 4-bit tensor type in ExecuTorch: int4 rows live in Byte buffers
_SCALE_BYTES = {torch.int8: 4, INT4: 2}
_HALF_MAX = 65504.0


def quantized(dtype: torch.dtype) -> bool:
    return dtype in _SCALE_BYTES


def _groups(dim: int) -> int:
    return -(-dim // GROUP)


def row_width(dtype: torch.dtype, dim: int) -> int:
    """Stored elements of a row of `dim` values: the last dim of a cache buffer."""
    if not quantized(dtype):
        return dim
    values = dim if dtype == torch.int8 else -(-dim // 2)
    return values + _SCALE_BYTES[dtype] * _groups(dim)


def stored_dim(buf: torch.Tensor) -> int:
    """The values per row of a cache buffer (its last dim, less a quantized row's scales; int4 rows: even dims)."""
    width = buf.shape[-1]
    if not quantized(buf.dtype):
        return width
    dim = next((d for d in range(1, 2 * width + 1)
                if row_width(buf.dtype, d) == width and (buf.dtype != INT4 or d % 2 == 0)), None)
    if dim is None:
        raise ValueError(f"no {'int8' if buf.dtype == torch.int8 else 'int4'} K/V row is {width} elements wide")
    return dim


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] rotated: a Walsh-Hadamard transform over each block of the largest power of two dividing n, times
    1 / sqrt(block) (orthonormal, its own inverse). The C++ hadamard_rows' butterflies in its order, in fp32."""
    n = x.shape[-1]
    block = n & -n
    if block < 2:
        return x.float()
    y = x.float().unflatten(-1, (n // block, block))
    h = 1
    while h < block:
        pairs = y.unflatten(-1, (block // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), -2).flatten(-3)
        h *= 2
    s = 1 / torch.tensor(float(block), dtype=torch.float32).sqrt()
    return (y * s).flatten(-2)


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., n] as storage rows of `dtype` ([..., row_width(dtype, n)])."""
    if not quantized(dtype):
        return x.to(dtype)
    four = dtype == INT4
    n = x.shape[-1]
    groups = _groups(n)
    xf = hadamard(x) if four else x.float()
    xf = torch.nn.functional.pad(xf, (0, groups * GROUP - n)).unflatten(-1, (groups, GROUP))
    if four:  # the value of largest magnitude (the first of equals) over -8, in fp16
        top = torch.gather(xf, -1, xf.abs().argmax(-1, keepdim=True))
        scale = (top / -8).clamp(-_HALF_MAX, _HALF_MAX).half().float()
        lo, hi = -8, 7
    else:
        scale = xf.abs().amax(-1, keepdim=True) / 127
        lo, hi = -127, 127
    q = torch.where(scale != 0, torch.round(xf / torch.where(scale != 0, scale, 1.0)), 0.0).clamp(lo, hi)
    values = q.flatten(-2)[..., :n]
    if four:
        scales = scale.squeeze(-1).half().flip(-1).contiguous().view(torch.uint8)
        nibbles = torch.nn.functional.pad((values + 8).to(torch.uint8), (0, n % 2), value=8)
        values = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
        return torch.cat([scales, values], -1)
    scales = scale.squeeze(-1).flip(-1).contiguous().view(torch.int8)  # the last group's first
    return torch.cat([scales, values.to(torch.int8)], -1)


def decode(rows: torch.Tensor) -> torch.Tensor:
    """Storage rows as values: float rows as they are, quantized rows times their groups' scales (fp32; int4 rows
    rotated back)."""
    if not quantized(rows.dtype):
        return rows
    n = stored_dim(rows)
    head = _SCALE_BYTES[rows.dtype] * _groups(n)
    if rows.dtype == torch.int8:
        scales = rows[..., :head].contiguous().view(torch.float32).flip(-1)
        return rows[..., head:].float() * scales.repeat_interleave(GROUP, -1)[..., :n]
    scales = rows[..., :head].contiguous().view(torch.float16).flip(-1).float()
    packed = rows[..., head:]
    values = torch.stack((packed & 0x0F, packed >> 4), -1).flatten(-2)[..., :n].float() - 8
    return hadamard(values * scales.repeat_interleave(GROUP, -1)[..., :n])
