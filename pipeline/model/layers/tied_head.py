"""A tied model's lm_head over the embedding's own int8 table, so the program stores that table once.

XNNPACK serializes a delegated linear's weight into its own payload: a tied lm_head that runs there is a second copy
of the embedding (1.68 bits/weight on SmolLM2, over 4 on gemma3). Where the quantize stage re-tied the head to an
8-bit per-row embedding, export (`export.store_tied_once`) swaps the head for `llmpipe::tied_head` over the same
int8 values (native/src/kernels/tied_head_kernel.cpp); the emitter keeps one constant for the two readers, because it
stores constants by content.

    llmpipe::tied_head(x [..., D] fp32, qweight [V, D] int8, scales [V] fp32) -> [..., V]
    out[..., v] = scales[v] * sum_d x[..., d] * qweight[v, d]   (fp32 activations, as an 8-bit weight-only linear)

The twin sums in fp32; the kernel rounds each activation row to int16 first (error at most 2^-16 of the row's largest
value, `rounding_bound`) so that it sums int16 pair products, several times fewer instructions a weight. Those sums are
exact integers on every ISA path of the kernel, so `tied_head_int_ref` (the kernel's own arithmetic) gives its bits.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.model.layers.attention import define_op

NAMESPACE, OP = "llmpipe", "tied_head"
QUALNAME = f"{NAMESPACE}::{OP}"
ROWS_AT_ONCE = 8192  # the twin dequantizes this many rows at a time, never the whole table


def tied_head_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or x.shape[-1] != qweight.shape[1]:
        raise ValueError(f"{QUALNAME}: qweight must be int8 [V, D] and x [..., D], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}, x {tuple(x.shape)}")
    V = qweight.shape[0]
    if scales.numel() != V:
        raise ValueError(f"{QUALNAME}: scales must hold {V} values (one per row), got {tuple(scales.shape)}")
    xf, s = x.float(), scales.reshape(-1).float()
    out = xf.new_empty(*x.shape[:-1], V)
    for r in range(0, V, ROWS_AT_ONCE):
        w = qweight[r:r + ROWS_AT_ONCE].float()
        out[..., r:r + ROWS_AT_ONCE] = (xf @ w.T) * s[r:r + ROWS_AT_ONCE]
    return out


LEVELS = 32639  # the kernel's int16 range: the largest that splits into two int8 halves (its ARM dotprod path)


def tied_head_int_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic, bit for bit: each row of x rounded to int16 (half to even, scale amax / LEVELS), its
    exact integer dot with each weight row, then fp32(dot) * scale[v] * the row's scale."""
    xf = x.float().reshape(-1, x.shape[-1])
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(float(LEVELS)) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv).clamp(-LEVELS, LEVELS).to(torch.int64)
    dots = xq @ qweight.to(torch.int64).T  # exact
    out = dots.float() * scales.reshape(1, -1).float() * (amax / LEVELS)
    return out.reshape(*x.shape[:-1], qweight.shape[0])


def rounding_bound(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The most the kernel's int16 rounding of x moves each output: half a step (amax / LEVELS) a column, times the
    row's |weights| and scale."""
    step = x.float().abs().amax(-1, keepdim=True) / LEVELS
    return step / 2 * (qweight.float().abs().sum(1) * scales.reshape(-1).float().abs())


def _define() -> None:
    globals()["_LIB"] = define_op(NAMESPACE, OP, "Tensor x, Tensor qweight, Tensor scales", "a", tied_head_ref,
                                  lambda x, qweight, scales: x.new_empty(*x.shape[:-1], qweight.shape[0],
                                                                         dtype=torch.float32))


if not hasattr(getattr(torch.ops, NAMESPACE), OP):
    _define()


class TiedHead(nn.Module):
    """The lm_head as llmpipe::tied_head over the embedding's int8 values (the same tensor) and its row scales."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales.reshape(-1).float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llmpipe.tied_head(x.float(), self.qweight, self.scales).to(x.dtype)


def shared_table(model: nn.Module):
    """The tied 8-bit per-row table (torchao's int weight) the embedding and lm_head share, or None with the reason."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is not embed.weight:
        return None, "the lm_head is quantized apart from the embedding (their schemes differ)"
    w = embed.weight
    if getattr(w, "target_dtype", None) != torch.int8 or not hasattr(w, "qdata"):
        return None, "the shared weight is not 8-bit (tied_head reads int8 rows)"
    if tuple(w.block_size) != (1, w.qdata.shape[1]):
        return None, f"the shared weight is not quantized per row (block size {tuple(w.block_size)})"
    if w.zero_point is not None and bool((w.zero_point != 0).any()):
        return None, "the shared weight has zero points (tied_head is symmetric)"
    if getattr(w, "activation_quantization", None) is not None:
        return None, "the lm_head quantizes its activations"
    return w, None


def store_tied_once(model: nn.Module) -> dict:
    """Swap a re-tied 8-bit lm_head for TiedHead over the embedding's table; returns what was done (nothing for a
    model that does not tie)."""
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return {}
    w, why = shared_table(model)
    if w is None:
        return {"tied_head": False, "tied_head_why": why}
    model.set_output_embeddings(TiedHead(w.qdata, w.scale))
    return {"tied_head": True}
