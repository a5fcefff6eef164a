"""backend=xnnpack on the transformers exporter's route: the quantize stage's model in forms the exporter's stock
lowering gets right.

- Weight-only linears take the forms of weight_only.py (the exporter's stock partitioner would drop torchao's
  scales); that partitioner delegates neither form, so they run on portable kernels (correct, slower; the
  delegation report shows it). 8da4w linears are delegated as they are.
- Quantized embeddings become `quantized_decomposed::embedding_{byte,4bit}`: the exporter runs no quant fusion at
  to_executorch, so torchao's `dequantize_affine` would be left without an out variant.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.config import v
from pipeline.model.quant.schemes import SCHEMES

BITS = {name: s.bits for name, s in SCHEMES.items() if s.weight_only}


class QuantizedEmbedding(nn.Module):
    """A torchao weight-only embedding as `quantized_decomposed::embedding_byte` / `embedding_4bit`.

    Same numbers as torchao's dequantize ((q - zero_point) * scale, small integers times a float), but an op with
    an out variant in ExecuTorch's quantized kernels, so no quant-fusion pass is needed at to_executorch.
    """

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, zero_point, bits: int):
        super().__init__()
        self.bits = bits
        self.qmin, self.qmax = (-8, 7) if bits == 4 else (-128, 127)
        if bits == 4:  # two values a byte, offset to [0, 15], even column in the high nibble (the kernel's layout)
            u = (qdata.to(torch.int16) + 8).to(torch.uint8)
            qdata = (u[:, 0::2] << 4) | u[:, 1::2]
        self.register_buffer("qweight", qdata.contiguous())
        self.register_buffer("scales", scale.to(torch.float32).contiguous())
        zp = None if zero_point is None or not bool((zero_point != 0).any()) else \
            zero_point.to(torch.float32).reshape(self.scales.shape).contiguous()
        self.register_buffer("zero_points", zp)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        op = torch.ops.quantized_decomposed.embedding_4bit if self.bits == 4 else \
            torch.ops.quantized_decomposed.embedding_byte
        return op.default(self.qweight, self.scales, self.zero_points, self.qmin, self.qmax, indices)


def quantized_embeddings(model: nn.Module, bits: int) -> int:
    """Swap torchao weight-only embeddings for QuantizedEmbedding; returns how many."""
    import executorch.exir.passes._quant_patterns_and_replacements  # noqa: F401  (defines the embedding ops)
    n = 0
    for _, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            w = getattr(child, "weight", None)
            if not (isinstance(child, nn.Embedding) and hasattr(w, "qdata")):
                continue
            if list(w.block_size)[0] != 1:
                raise ValueError(f"embedding {name}: unsupported block size {w.block_size}")
            scale = w.scale[:, 0] if w.scale.dim() == 2 and w.scale.shape[1] == 1 else w.scale
            zp = None if w.zero_point is None else w.zero_point.reshape(w.scale.shape)
            if zp is not None and zp.dim() == 2 and zp.shape[1] == 1:
                zp = zp[:, 0]
            setattr(parent, name, QuantizedEmbedding(w.qdata, scale, zp, bits))
            n += 1
    return n


def handover(model: nn.Module, q) -> dict:
    """Rewrite `model` in place; returns what was done (for the manifest)."""
    from pipeline.backends.xnnpack.weight_only import prepare_weight_only_linears
    lin, emb = v(q.linear), v(q.embedding)
    done = {}
    if lin in BITS:
        forms = prepare_weight_only_linears(model, BITS[lin])
        done["linear_forms"] = {"quantized_decomposed::dequantize_per_channel + linear": forms["xnnpack_per_channel"],
                                "quantized_decomposed::mixed_linear": forms["mixed_linear"]}
    elif lin == "8da4w":
        done["linear_forms"] = {"torchao 8da4w (XNNPACK dynamically quantized linear)":
                                sum(hasattr(m.weight, "qdata") for m in model.modules() if isinstance(m, nn.Linear))}
    if emb in BITS:
        done["quantized_embeddings"] = quantized_embeddings(model, BITS[emb])
        done["embedding_form"] = f"quantized_decomposed::{'embedding_4bit' if emb == '4w' else 'embedding_byte'}"
    return done
