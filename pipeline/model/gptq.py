"""GPTQ (`quantize.algorithm=gptq`): each linear's int weights rounded column by column, the error of each column
spread over the columns not yet rounded, weighted by the Hessian of the layer's loss, H = X^T X over calibration
inputs X. A weight that rounds badly is made up for by its neighbours on the inputs that move with it.

- Hessians: `hessians` runs the float model (smoothed first, when quantize.smoothing is on, so the inputs are the ones
  the quantized linears will see) over the calibration text (bench/corpus/calibration.txt) and keeps X^T X / n per
  linear; linears that read one input share one tensor. The calibrate stage stores them (pipeline/stages/calibrate.py).
- Scales: symmetric, as torchao's (amax / ((qmax - qmin) / 2)), per group of `group` columns (0: per row), picked per
  row at the group's first column from the columns as they stand then, among a few clip ratios of the amax: the one
  with the least error weighted by H's diagonal (each input's mean square, the weighting llama.cpp's imatrix uses).
  4-bit group scales are rounded to bf16 first: XNNPACK stores them so.
- Deterministic: no sampling, and the calibration text is fixed.
"""
from __future__ import annotations

import torch
from torch import nn

BLOCK = 128                   # columns rounded before their error is spread over the rest at once
DAMP = 0.01                   # H's diagonal grows by this fraction of its mean (a singular H still inverts)
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def hessians(model: nn.Module, sequences: list[list[int]], names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """X^T X / n of each linear's input over uncached forwards of `model` (names: only these linears). Linears that
    read one tensor (q/k/v, gate/up) share one sum: measured once, stored once."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    owner: dict[str, str] = {}               # linear -> the linear whose sum it shares
    live: dict[int, tuple] = {}              # this forward's inputs so far (held, so no id is reused meanwhile)
    hooks = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or (names is not None and name not in names):
            continue

        def hook(_, args, key=name):
            x = args[0]
            seen = live.get(id(x))
            if seen is not None and seen[0] is x:
                owner.setdefault(key, seen[1])
                return
            live[id(x)] = (x, key)
            flat = x.detach().reshape(-1, x.shape[-1]).float()
            sums[key] = sums[key] + flat.T @ flat if key in sums else flat.T @ flat
            counts[key] = counts.get(key, 0) + flat.shape[0]
        hooks.append(m.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for ids in sequences:
                live.clear()
                model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        live.clear()
        for h in hooks:
            h.remove()
    out = {key: s.div_(counts[key]) for key, s in sums.items()}
    out.update({key: out[first] for key, first in owner.items() if first in out})
    return out


def _round_scale(s: torch.Tensor, bf16: bool) -> torch.Tensor:
    return s.to(torch.bfloat16).float() if bf16 else s


def best_scales(w: torch.Tensor, importance: torch.Tensor, bits: int, bf16: bool) -> torch.Tensor:
    """Per row of w [rows, cols], the symmetric scale (among CLIPS of the amax) with the least importance-weighted
    squared rounding error."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    amax = w.abs().amax(1).clamp_min(1e-12)
    best, best_err = None, None
    for c in CLIPS:
        s = _round_scale(amax * c / ((qmax - qmin) / 2), bf16).clamp_min(1e-12)
        err = ((w - torch.clamp(torch.round(w / s[:, None]), qmin, qmax) * s[:, None]) ** 2 * importance).sum(1)
        if best is None:
            best, best_err = s, err
        else:
            take = err < best_err
            best, best_err = torch.where(take, s, best), torch.where(take, err, best_err)
    return best


def gptq(weight: torch.Tensor, h: torch.Tensor, bits: int, group: int, bf16_scales: bool):
    """(int values [out, in] int8, scales [out, in // group] (per row: [out, 1]) fp32) of weight [out, in]."""
    w = weight.detach().float().clone()
    rows, cols = w.shape
    g = group if group > 0 else cols
    if cols % g:
        raise ValueError(f"gptq: {cols} columns do not split into groups of {g}")
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    h = h.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    importance = h.diagonal().float().clone()
    h.diagonal().add_(DAMP * h.diagonal().mean())
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    q = torch.zeros(rows, cols, dtype=torch.int8)
    scales = torch.zeros(rows, cols // g)
    if group <= 0:
        scales[:, 0] = best_scales(w, importance, bits, False)
    block = max(BLOCK // g, 1) * g if group > 0 else BLOCK
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1, err, hb = w[:, i1:i2].clone(), torch.zeros(rows, i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            if group > 0 and c % g == 0:
                scales[:, c // g] = best_scales(w1[:, i:i + g], importance[c:c + g], bits, bf16_scales)
            s = scales[:, c // g]
            qc = torch.clamp(torch.round(w1[:, i] / s), qmin, qmax)
            q[:, c] = qc.to(torch.int8)
            e = (w1[:, i] - qc * s) / hb[i, i]
            w1[:, i:] -= e[:, None] * hb[i, i:][None, :]
            err[:, i] = e
        w[:, i2:] -= err @ hinv[i1:i2, i2:]
    return q, scales


def apply(module: nn.Module, float_weight: torch.Tensor, h: torch.Tensor) -> bool:
    """Replace the int values and scales of a torchao-quantized linear (IntxUnpackedToInt8Tensor, symmetric) with
    GPTQ's from its float weight; False where it cannot (another layout)."""
    from torchao.quantization import IntxUnpackedToInt8Tensor
    w = module.weight
    if type(w) is not IntxUnpackedToInt8Tensor or w.target_dtype not in (torch.int4, torch.int8):
        return False
    bits = 4 if w.target_dtype == torch.int4 else 8
    group = w.block_size[1] if w.block_size[1] < w.qdata.shape[1] else 0
    q, s = gptq(float_weight, h, bits, group, bf16_scales=bits == 4 and group > 0)
    zero = None if w.zero_point is None else torch.zeros_like(w.zero_point)
    module.weight = nn.Parameter(IntxUnpackedToInt8Tensor(
        q, s.to(w.scale.dtype).reshape(w.scale.shape), zero, w.target_dtype, w.block_size, w.dtype,
        w.activation_quantization), requires_grad=False)
    return True
