"""K/V storage rows, as the C++ caches keep them (native/src/kernels/kv_attention.h): float rows of the storage
dtype, or int8 rows that carry their own scales.

An int8 row of n values holds them in groups of 32 (the last may be shorter), each group symmetric with an fp32 scale
(scale = max |x| / 127, value = round half to even of x / scale, in fp32). The scales come first, the last group's
first, so the C++ reader finds a group's scale from the values' address; then the values. A row is self-contained:
wherever it moves (a ring slot, a batched cell, a prefix snapshot) its scales go with it. The rounding is the C++
quantize_row's (kernels/kv_rows.h), bit for bit. Groups of 32 rather than one scale a row: SmolLM2's keys have outlier
channels, and a row's scale set by them rounds the rest coarsely (groups of 32 halved the KLD against fp32 K/V,
measured eagerly on three held-out domains).
"""
from __future__ import annotations

import torch

GROUP = 32


def quantized(dtype: torch.dtype) -> bool:
    return dtype == torch.int8


def _groups(dim: int) -> int:
    return -(-dim // GROUP)


def row_width(dtype: torch.dtype, dim: int) -> int:
    """Stored elements of a row of `dim` values: the last dim of a cache buffer."""
    return dim + 4 * _groups(dim) if quantized(dtype) else dim


def stored_dim(buf: torch.Tensor) -> int:
    """The values per row of a cache buffer (its last dim, less an int8 row's scales)."""
    width = buf.shape[-1]
    if not quantized(buf.dtype):
        return width
    dim = next((width - 4 * g for g in range(1, width // 4 + 1) if GROUP * (g - 1) < width - 4 * g <= GROUP * g),
               None)
    if dim is None:
        raise ValueError(f"no int8 K/V row is {width} elements wide")
    return dim


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., n] as storage rows of `dtype` ([..., row_width(dtype, n)])."""
    if not quantized(dtype):
        return x.to(dtype)
    n = x.shape[-1]
    groups = _groups(n)
    xf = torch.nn.functional.pad(x.float(), (0, groups * GROUP - n)).unflatten(-1, (groups, GROUP))
    scale = xf.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(xf / torch.where(scale > 0, scale, 1.0)), 0.0).clamp(-127, 127)
    values = q.flatten(-2)[..., :n].to(torch.int8)
    scales = scale.squeeze(-1).flip(-1).contiguous().view(torch.int8)  # the last group's first
    return torch.cat([scales, values], -1)


def decode(rows: torch.Tensor) -> torch.Tensor:
    """Storage rows as values: float rows as they are, int8 rows times their groups' scales (fp32)."""
    if not quantized(rows.dtype):
        return rows
    n = stored_dim(rows)
    head = 4 * _groups(n)
    scales = rows[..., :head].contiguous().view(torch.float32).flip(-1)
    return rows[..., head:].float() * scales.repeat_interleave(GROUP, -1)[..., :n]
