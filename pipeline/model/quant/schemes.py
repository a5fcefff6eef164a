"""The quantization schemes, as one table: what a weight of each stores, whether its activations are quantized at run
time, and which backends run it. The quantize stage, preflight, the backends, verify and the target-bits allocator
(pipeline/model/quant/allocate.py) read this table; each backend's own group-size rules stay in its `refuses`.

    none   float weights (the export dtype)
    8w 4w  int weights with fp32/half activations (weight-only), per output channel or in groups
    8da8w 8da4w  int weights with int8 activations quantized per row at run time (XNNPACK's dynamic GEMMs)
    nvfp4  fp4 (e2m1) values in groups of 16 with fp8 scales (MLX)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional



@dataclass(frozen=True)
class Scheme:
    name: str
    bits: Optional[int]                 # weight bits; None: not quantized
    dynamic: bool = False               # int8 activations quantized per row at run time
    fp4: bool = False                   # e2m1 values with fp8 scales per 16 (nvfp4)
    backends: Optional[tuple[str, ...]] = None  # the backends that run it; None: every backend

    def runs_on(self, backend: str) -> bool:
        return self.backends is None or backend in self.backends

    @property
    def weight_only(self) -> bool:
        """Int weights under float activations (the form XNNPACK's stock partitioner mishandles)."""
        return self.bits is not None and not self.dynamic and not self.fp4

    def file_bits(self, group: int, n_in: int, scale_bits: tuple[int, int], float_bits: int = 32) -> float:
        """Bits a weight takes in the program file, its scale (and MLX's bias) shared by its group (0: per row);
        scale_bits: the backend's SCALE_BITS, what its file keeps per group and per row."""
        if self.bits is None:
            return float(float_bits)
        if self.fp4:
            return 4 + 8 / 16
        per = group if group > 0 else n_in
        return self.bits + scale_bits[0 if group > 0 else 1] / per

    def module_bytes(self, group: int, float_bytes: int) -> float:
        """Bytes a weight takes in the eager quantized module: torchao holds 4-bit values in int8, and each group
        adds a scale and a zero point; nvfp4 packs two values a byte with an fp8 scale per 16."""
        if self.bits is None:
            return float(float_bytes)
        if self.fp4:
            return 0.5 + 1 / 16
        return 1 + (8 / group if group else 0)


SCHEMES = {s.name: s for s in (
    Scheme("none", None),
    Scheme("8w", 8),
    Scheme("4w", 4),
    Scheme("8da4w", 4, dynamic=True, backends=("xnnpack", "portable")),
    Scheme("8da8w", 8, dynamic=True, backends=("xnnpack", "portable")),
    Scheme("nvfp4", 4, fp4=True, backends=("mlx",)),
)}


def runs_on(backend: str) -> list[str]:
    return [name for name, s in SCHEMES.items() if s.runs_on(backend)]


def refused_by(scheme: str, backend: str) -> Optional[str]:
    """Why `backend` does not run `scheme` at all (None: it does, subject to its own group rules)."""
    if SCHEMES[scheme].runs_on(backend):
        return None
    why = {"nvfp4": "its fp4 matmul is an MLX kernel",
           "8da4w": "the MLX partitioner does not take torchao's dynamic activation quantization "
                    "(choose_qparams_affine / quantize_affine / dequantize_affine stay outside the delegate and have "
                    "no out variants, so lowering fails with 'Missing out variants')"}
    where = " or ".join(f"backend={b}" for b in SCHEMES[scheme].backends)
    return (f"{scheme} runs on {where} only ({why['nvfp4' if SCHEMES[scheme].fp4 else '8da4w']}); allowed here: "
            f"{runs_on(backend)}")
