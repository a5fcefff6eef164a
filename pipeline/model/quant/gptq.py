"""GPTQ (`quantize.algorithm=gptq`): each linear's int weights rounded column by column, the error of each column
spread over the columns not yet rounded, weighted by the Hessian of the layer's loss, H = X^T X over calibration
inputs X. A weight that rounds badly is made up for by its neighbours on the inputs that move with it.

- Hessians: X^T X / n per linear of the float model over the calibration set (pipeline/corpus.py); with
  quantize.smoothing, of the smoothed model, whose inputs the quantized linears will see (`rescaled`: H / (s s^T),
  measured in the pass that finds smoothing's maxima); linears that read one input share one tensor. The calibrate
  stage stores them (pipeline/stages/calibrate.py).
- Scales: symmetric, as torchao's (amax / ((qmax - qmin) / 2)), per group of `group` columns (0: per row), picked per
  row at the group's first column from the columns as they stand then, among a few clip ratios of the amax: the one
  with the least error weighted by H's diagonal (each input's mean square, the weighting llama.cpp's imatrix uses).
  4-bit group scales are rounded to bf16 first: XNNPACK stores them so.
- Deterministic: no sampling, and the calibration text is fixed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

BLOCK = 128                   # columns rounded before their error is spread over the rest at once
DAMP = 0.01                   # H's diagonal grows by this fraction of its mean (a singular H still inverts)
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


class HessianSums:
    """X^T X of each linear's input, summed by forward pre-hooks from construction until `close`. Linears that read one
    tensor (q/k/v, gate/up) share one sum: measured once, stored once."""

    def __init__(self, model: nn.Module, names: set[str] | None = None):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.owner: dict[str, str] = {}          # linear -> the linear whose sum it shares
        self.live: dict[int, tuple] = {}         # this forward's inputs so far (held, so no id is reused meanwhile)
        self.hooks = [m.register_forward_pre_hook(self._hook(name)) for name, m in model.named_modules()
                      if isinstance(m, nn.Linear) and (names is None or name in names)]

    def _hook(self, key: str):
        def hook(_, args):
            x = args[0]
            seen = self.live.get(id(x))
            if seen is not None and seen[0] is x:
                self.owner.setdefault(key, seen[1])
                return
            self.live[id(x)] = (x, key)
            flat = x.detach().reshape(-1, x.shape[-1]).float()
            self.sums[key] = self.sums[key] + flat.T @ flat if key in self.sums else flat.T @ flat
            self.counts[key] = self.counts.get(key, 0) + flat.shape[0]
        return hook

    def next_forward(self) -> None:
        self.live.clear()

    def close(self) -> dict[str, torch.Tensor]:
        """Removes the hooks; X^T X / n per linear (sharers hold one tensor)."""
        self.live.clear()
        for h in self.hooks:
            h.remove()
        out = {key: s.div_(self.counts[key]) for key, s in self.sums.items()}
        out.update({key: out[first] for key, first in self.owner.items() if first in out})
        return out


def hessians(model: nn.Module, sequences: list[list[int]], names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """X^T X / n of each linear's input over uncached forwards of `model` (names: only these linears)."""
    sums = HessianSums(model, names)
    try:
        with torch.no_grad():
            for ids in sequences:
                sums.next_forward()
                model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        out = sums.close()
    return out


def rescaled(h: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hessians of inputs divided channel-wise by `scales` (linear -> its input's divisor, what smoothing folds
    in): H / (s s^T), so one forward measures both smoothing's maxima and the smoothed model's Hessians. Sharers of
    one input share its scales (one tensor, from one smoothing group): the shared sum is rescaled once, stays shared."""
    done: dict[tuple[int, int], torch.Tensor] = {}
    out = {}
    for key, t in h.items():
        s = scales.get(key)
        if s is None:
            out[key] = t
            continue
        if (id(t), id(s)) not in done:
            f = s.float()
            done[id(t), id(s)] = t / (f[:, None] * f[None, :])
        out[key] = done[id(t), id(s)]
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


class Prepared(NamedTuple):
    """What GPTQ needs of a Hessian, whichever linear reads its input (q/k/v and gate/up share one)."""
    hinv: torch.Tensor        # the upper Cholesky factor of the damped H's inverse, fp32
    importance: torch.Tensor  # H's diagonal: each input's mean square
    dead: torch.Tensor        # inputs that were always zero


def prepare(h: torch.Tensor) -> Prepared:
    """The upper Cholesky factor U of H^-1 (H^-1 = U^T U), from one Cholesky of H with its rows and columns reversed:
    if J H J = L L^T then U = J L^-1 J. A third of the work of factoring, inverting and factoring again, with the
    same fp32 result."""
    h = h.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1
    importance = h.diagonal().float().clone()
    h.diagonal().add_(DAMP * h.diagonal().mean())
    low = torch.linalg.cholesky(h.flip(0, 1))
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.solve_triangular(low, eye, upper=False).flip(0, 1).float()
    return Prepared(hinv, importance, dead)


def gptq(weight: torch.Tensor, h, bits: int, group: int, bf16_scales: bool):
    """(int values [out, in] int8, scales [out, in // group] (per row: [out, 1]) fp32) of weight [out, in]; `h`: the
    Hessian, or prepare()'s of it."""
    w = weight.detach().float().clone()
    rows, cols = w.shape
    g = group if group > 0 else cols
    if cols % g:
        raise ValueError(f"gptq: {cols} columns do not split into groups of {g}")
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    hinv, importance, dead = h if isinstance(h, Prepared) else prepare(h)
    w[:, dead] = 0
    q = torch.zeros(cols, rows)  # by column: filled a row at a time
    scales = torch.zeros(rows, cols // g)
    if group <= 0:
        scales[:, 0] = best_scales(w, importance, bits, False)
    block = max(BLOCK // g, 1) * g if group > 0 else BLOCK
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        # the block transposed, so a column of w is a contiguous row here (the same arithmetic, 2-3x faster)
        wt, err, hb = w[:, i1:i2].T.contiguous(), torch.empty(i2 - i1, rows), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            if group > 0 and c % g == 0:
                scales[:, c // g] = best_scales(wt[i:i + g].T, importance[c:c + g], bits, bf16_scales)
            s = scales[:, c // g]
            qc = torch.clamp(torch.round(wt[i] / s), qmin, qmax)
            q[c] = qc
            e = (wt[i] - qc * s) / hb[i, i]
            wt[i:] -= hb[i, i:, None] * e[None, :]
            err[i] = e
        w[:, i2:] -= err.T @ hinv[i1:i2, i2:]
    return q.T.to(torch.int8).contiguous(), scales


def apply(module: nn.Module, float_weight: torch.Tensor, h) -> bool:
    """Replace the int values and scales of a torchao-quantized linear (IntxUnpackedToInt8Tensor, symmetric) with
    GPTQ's from its float weight (`h`: its Hessian, or prepare()'s of it); False where it cannot (another layout)."""
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
