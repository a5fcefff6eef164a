"""Eager torchao embeddings that dequantize only the rows they gather.

Why: torchao's quantized embedding (IntxUnpackedToInt8Tensor) dequantizes the whole table on every call and then
gathers: 28M weights for SmolLM2's one-token decode step, 168M for gemma3's, a fifth of an eager quantized step.
Dequantization is elementwise with a scale (and zero point) per group of a row, so dequantizing the gathered rows
gives the same values. Only for eager evaluation (verify, fidelity): torch.export keeps torchao's form, which the
lowering matches, because this lives in a context, not in the table.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def _gathered(saved):
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS, dequantize_affine

    def embedding(func, types, args, kwargs):
        ids, w = args[0], args[1]
        if tuple(w.block_size)[0] != 1 or w.qdata.dim() != 2:  # groups spanning rows: as torchao does it
            return saved(func, types, args, kwargs)
        rows = ids.reshape(-1)
        qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[w.target_dtype]
        zero = None if w.zero_point is None else w.zero_point[rows]
        out = dequantize_affine(w.qdata[rows], w.block_size, w.scale[rows], zero, torch.int8, qmin, qmax,
                                output_dtype=w.dtype)
        return out.reshape(*ids.shape, out.shape[-1])
    return embedding


@contextlib.contextmanager
def rows_only():
    """For the span, F.embedding over a torchao IntxUnpackedToInt8Tensor dequantizes the gathered rows only."""
    from torchao.quantization import IntxUnpackedToInt8Tensor as cls
    tables = [t[cls] for t in (getattr(cls, "_TORCH_FN_TABLE", {}), getattr(cls, "_ATEN_OP_TABLE", {})) if cls in t]
    keys = (F.embedding, torch.ops.aten.embedding.default)
    saved = [(t, k, t[k]) for t in tables for k in keys if k in t]
    for t, k, fn in saved:
        t[k] = _gathered(fn)
    try:
        yield
    finally:
        for t, k, fn in saved:
            t[k] = fn
