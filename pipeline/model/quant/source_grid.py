"""Carry the source file's quantization grid instead of re-quantizing it (quantize.source_grid=true).

A GGUF model arrives quantized: SmolLM2's linears are Q4_1 and its embedding Q8_0; gemma-3-270m's embedding is Q8_0.
transformers dequantizes them, and quantizing that float model again puts a second rounding on top of the first.
Where the target format holds the source's grid exactly, the source's blocks are carried instead:

- Q8_0 (symmetric int8, groups of 32, one fp16 scale each) -> an 8-bit scheme in groups of 32;
- Q4_0 (symmetric int4, groups of 32)                      -> a 4-bit scheme in groups of 32;
- Q4_1 (int4 with a float min, groups of 32)               -> a 4-bit scheme in groups of 32 with a float zero point,
  on backends that hold asymmetric weights (MLX: scale + bias).

Block layouts follow ggml (llama.cpp's ggml-common.h): a block is its fp16 scale `d` (Q4_1: then its fp16 min `m`),
then the quants (Q4_x: 16 bytes, the first 16 values in the low nibbles, the next 16 in the high ones). A carried
weight must dequantize to the float weight transformers loaded (within float rounding), or it is not carried.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

GROUP = 32
# GGUF tensor names of a layer's linear, by its role (pipeline/model/archs ROLES; the layer index fills blk.{i})
GGUF_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
              "down": "ffn_down"}


def gguf_name(hf_name: str, tied: bool, role: Optional[str] = None) -> Optional[str]:
    """The GGUF tensor of an HF module name and its role (model.layers.3.mlp.up_proj, up -> blk.3.ffn_up.weight)."""
    if hf_name in ("model.embed_tokens", "embed_tokens"):
        return "token_embd.weight"
    if hf_name == "lm_head":
        return "token_embd.weight" if tied else "output.weight"
    parts = hf_name.split(".")
    if "layers" not in parts or role not in GGUF_NAMES:
        return None
    return f"blk.{parts[parts.index('layers') + 1]}.{GGUF_NAMES[role]}.weight"


def _f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float()[..., 0]


def decode(raw: np.ndarray, kind: str, rows: int, cols: int):
    """(qdata int8 [rows, cols] centred on 0, scale [rows, cols/32], zero point [rows, cols/32] or None, bits)."""
    nb = cols // GROUP
    t = torch.from_numpy(np.array(raw)).reshape(rows, nb, -1)  # a copy: the file is memory-mapped read-only
    if kind == "Q8_0":
        return t[..., 2:].contiguous().view(torch.int8).reshape(rows, cols), _f16(t[..., :2]), None, 8
    head = 2 if kind == "Q4_0" else 4
    qs = t[..., head:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int8).reshape(rows, cols)  # [0, 15]
    d = _f16(t[..., :2])
    if kind == "Q4_0":
        return q - 8, d, None, 4
    m = _f16(t[..., 2:4])
    # d * q + m = d * ((q - 8) - zp) with zp = -8 - m / d; a block with d = 0 is the constant m
    safe = torch.where(d == 0, torch.ones_like(d), d)
    zp = torch.where(d == 0, -m, -8 - m / safe)
    return q - 8, safe, zp, 4


def qk_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers restores when it loads a Llama GGUF's q/k (llama.cpp interleaves RoPE halves)."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


class SourceGrid:
    """The quantized tensors of a GGUF file, by name."""

    def __init__(self, path: Path):
        import gguf
        self.reader = gguf.GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}

    def kind(self, name: str) -> Optional[str]:
        t = self.tensors.get(name)
        return t.tensor_type.name if t is not None else None

    def carried(self, name: str, weight: torch.Tensor, bits: int, group: int, asymmetric_ok: bool,
                activation_quantization, heads: Optional[int] = None):
        """The torchao weight holding the source's grid for `name`, or None when the target cannot hold it
        exactly (another type, bits or group, or a zero point the backend cannot keep)."""
        from torchao.quantization import IntxUnpackedToInt8Tensor
        kind = self.kind(name)
        if group != GROUP or kind not in ("Q8_0", "Q4_0", "Q4_1") or (kind == "Q4_1" and not asymmetric_ok):
            return None
        rows, cols = weight.shape
        q, scale, zp, src_bits = decode(self.tensors[name].data, kind, rows, cols)
        if src_bits != bits:
            return None
        # q/k of a Llama file are stored in llama.cpp's RoPE order: try the file's order, then transformers'
        for order in [torch.arange(rows)] + ([qk_rows(rows, heads)] if heads else []):
            zero = zp[order] if zp is not None else torch.zeros_like(scale, dtype=torch.int8)
            w = IntxUnpackedToInt8Tensor(qdata=q[order].contiguous(), scale=scale[order].contiguous(),
                                         zero_point=zero.contiguous(), block_size=(1, GROUP),
                                         target_dtype=torch.int8 if bits == 8 else torch.int4, dtype=weight.dtype,
                                         activation_quantization=activation_quantization)
            if torch.allclose(w.dequantize(), weight, rtol=1e-5, atol=1e-6):
                return w
        return None
