"""What an XNNPACK dynamically quantized linear computes, in torch: a reference for 8da4w / 8da8w builds.

Why: torchao's eager `Int8DynamicActivationIntxWeightConfig` linear is an emulation (quantize-dequantize the
activations per row with `choose_qparams_affine` / `quantize_affine`, dequantize the weights with fp32 scales, fp32
`F.linear`). XNNPACK's qd8-f32-qb4w / qd8-f32-qc8w GEMMs store 4-bit group scales as bf16, derive the activation
parameters their own way and compute in int32 with their own fp32 epilogue. `reference(module)` swaps every such
linear for one that follows XNNPACK step by step: on the same input it gives the program's output bit for bit
(tests/backends/test_xnnpack_numerics.py), so a verify can tell "XNNPACK's numerics" from "a wrong program".

What XNNPACK does (the XNNPACK commit ExecuTorch 1.5.1 pins, 2026-07-26/27; these paths have not changed since):
- Per-row activation parameters, src/xnnpack/quantization.h `xnn_qd8_asymmetric_quantization_params`: the row's
  min/max (src/operator-run.c `xnn_compute_f32_qx8_convert`, or src/pack-lh.cc when the FC packs its own LHS)
  widened to include 0; multiplier m = 255 / (max - min) in fp32 (1 for a constant row); TFLite's nudged zero point
  (from whichever end gives the smaller error, clamped to [-128, 127], rounded half-to-even with lrintf). The GEMM
  gets the dequantization scale as 1 / m (`xnn_f32_qd8_asymmetric_quantization_params`), not (max - min) / 255.
  On x86 with AVX-512 VNNI the activations are unsigned (qdu8: zero point + 128, range [0, 255]; src/subgraph.c
  `convert_gemm_to_qduint8`), which changes the float epilogue of the 4-bit kernel (below), not the integers.
- Quantizing, src/f32-qu8-vcvt/avx512skx.c.in (f32-qs8-vcvt likewise): q = sat(rne(x * m) + zero point), a fp32
  multiply by the multiplier, never a division, rounded half-to-even by cvtps2dq.
- qd8-f32-qb4w (4-bit groups), src/qd8-f32-qb4w-gemm/gen/qd8-f32-qb4w-gemm-1x16c8-minmax-avx512vnni-prfm.c: per
  group an exact int32 dot of the activations with 16 * w (the nibble sits in the high half of a byte), converted to
  fp32 and fma'd with the bf16 group scale / 16 (src/microparams-init.c `xnn_init_blockwise_scale_bf16_params`)
  into a running fp32 sum that starts at ksum * zero point; then times the row's dequantization scale, then + bias.
  ksum is packed in fp32 (src/reference/packing.cc `xnn_pack_qs8_qb4w_gemm_goi_w`, input zero point 1): minus the
  sum over chunks of 2 * kr = 16 input channels of (sum of the chunk's int4 weights) * bf16 group scale, subtracted
  one chunk after another. The scales are bf16 because ExecuTorch's serializer casts them
  (executorch/backends/xnnpack/operators/node_visitor.py `get_quant_params`); the int values themselves were chosen
  by torchao with the fp32 scales. The kernel zero point 8 (ExecuTorch stores w + 8) is folded out at packing.
- qd8-f32-qc8w (8-bit per channel, fp32 scales kept as they are),
  src/qd8-f32-qc8w-gemm/gen/qd8-f32-qc8w-gemm-1x64-minmax-asm-amd64-avx512vnni.S: int32 accumulator
  ksum * zero point + dot (exactly sum (q - zp) * w), converted to fp32, times the row's dequantization scale, then
  one fma with the channel scale and the bias. 4-bit per channel weights are lowered as qb4w with one group.

Exact integer sums do not depend on order, so those are computed with matmuls whose every partial sum is exact (fp32
for a 4-bit group's dot, float64 for an 8-bit row); every fp32 step is done in the order above, the fmas correctly
rounded (fmaf in native/'s kernel library, or a float64 sum rounded to odd in numpy). On an AVX-512 VNNI CPU the
whole 4-bit GEMM runs natively from packed 4-bit weights (llmpipe_qb4w_gemm: vpdpbusd dots, then the same chain),
the same bits. The order and the qdu8 epilogue are those of the x86 AVX-512 VNNI kernels (AVX2 and Arm kernels sum
in other orders: last-bit differences there).

How much each part matters: the bf16 group scales are nearly all of torchao's gap to an 8da4w program. The int8
activations themselves agree with torchao's except at near-ties (about 1 row in 100-1500 differs, by one step in one
or two elements), and the rest (1 / m, the epilogue order, qdu8) is last-bit. What stays eager (norms, attention,
rope, SiLU, the embeddings) is left as it is: XNNPACK's own rsqrt / sigmoid / sin / cos / softmax / bmm differ from
torch's in the last bits and flip an activation rounding now and then, so end to end the reference is closer to the
program than torchao's module, not identical to it.
"""
from __future__ import annotations

import copy
import ctypes
import functools
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

QMIN, QMAX = -128, 127     # XNNPACK's qd8 range; qdu8 shifts it and the zero point by 128
KSUM_CHUNK = 16            # input channels per ksum term in the qb4w packing (2 * kr, kr = 8 on x86 AVX2/AVX-512)


@functools.cache
def cpu_flags() -> frozenset:
    try:
        line = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


def follows_this_cpu() -> bool:
    """Whether this CPU runs the kernels the emulation follows bit for bit (x86 AVX-512 VNNI, qdu8 activations,
    no AMX); elsewhere XNNPACK picks other kernels whose sums and epilogues differ in the last bits."""
    flags = cpu_flags()
    return "avx512_vnni" in flags and "amx_int8" not in flags


def unsigned_activations() -> bool:
    """XNNPACK converts dynamically quantized activations to unsigned (qdu8) where the CPU has VNNI."""
    return bool({"avx512_vnni", "avx_vnni"} & cpu_flags())


# --- activations: per-row parameters and quantization ----------------------------------------------------------

def row_qparams(x: torch.Tensor, unsigned: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(multiplier, dequantization scale, zero point) per row of x [M, K] fp32, as XNNPACK derives them."""
    rmin = torch.clamp(x.amin(-1), max=0.0)      # the range always includes 0
    rmax = torch.clamp(x.amax(-1), min=0.0)
    same = rmin == rmax
    # a true fp32 division (a python number over a tensor would be torch's reciprocal-then-multiply: 1 ulp off)
    span = torch.full_like(rmin, QMAX - QMIN)
    mult = torch.where(same, torch.ones_like(rmin), torch.div(span, torch.where(same, 1.0, rmax - rmin)))
    lo, hi = rmin * mult, rmax * mult            # the range in quantized units (fp32 products, as in C)
    # TFLite's nudge: the zero point from the end whose error is smaller
    zp = torch.where((QMIN + lo) + (QMAX + hi) > 0, QMIN - lo, QMAX - hi)
    zp = torch.round(zp.clamp(QMIN, QMAX))       # lrintf: half to even, as torch.round
    if unsigned:
        zp = zp + 128
    dq = torch.div(torch.ones_like(mult), mult)  # the GEMM dequantizes with 1/m (fp32), not (max - min) / 255
    return mult, dq, zp.to(torch.int32)


def quantize_rows(x: torch.Tensor, mult: torch.Tensor, zp: torch.Tensor, unsigned: bool = True) -> torch.Tensor:
    """The quantized activations (integer values, as float64): sat(rne(x * m) + zp)."""
    lo, hi = (0, 255) if unsigned else (QMIN, QMAX)
    q = torch.round(x * mult[:, None]).double() + zp[:, None].double()
    return q.clamp(lo, hi)


# --- fp32 arithmetic that matches the kernels -----------------------------------------------------------------

def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 a * b + c with one rounding (vfmadd), for fp32 arrays.

    a * b is exact in float64; the sum is rounded to odd in float64 (round to nearest, then, if inexact and the
    result is even, one step towards the exact value), which then rounds to fp32 exactly as a single rounding would.
    numpy, not torch: the chains below run thousands of these on small arrays, where torch's per-op cost dominates.
    """
    p = a.astype(np.float64) * b.astype(np.float64)
    c = c.astype(np.float64)
    s = p + c
    t = s - p
    err = (p - (s - t)) + (c - t)                # TwoSum: p + c == s + err exactly
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c with one rounding, for fp32 tensors (broadcasting)."""
    return torch.from_numpy(_fma32(a.float().numpy(), b.float().numpy(), c.float().numpy()))


def fma32_chain(terms: torch.Tensor, scales: torch.Tensor, start: torch.Tensor, native: bool = True) -> torch.Tensor:
    """out = start, then out = fma32(terms[g], scales[g], out) for g in order: terms [G, M, N], scales [G, N].

    In C (fmaf, one rounding) where native/'s kernel library is built, else in numpy: the same bits, the C a few
    hundred times faster (verify runs this chain for the 4-bit linears the native GEMM does not take)."""
    out, t, s = start.float().contiguous().numpy().copy(), terms.float().contiguous().numpy(), \
        scales.float().contiguous().numpy()
    lib = _native_chain() if native else None
    if lib is not None:
        f = ctypes.POINTER(ctypes.c_float)
        lib(t.ctypes.data_as(f), s.ctypes.data_as(f), out.ctypes.data_as(f), t.shape[0], t.shape[1], t.shape[2])
        return torch.from_numpy(out)
    for g in range(t.shape[0]):
        out = _fma32(t[g], s[g][None, :], out)
    return torch.from_numpy(out)


@functools.cache
def _kernels_library():
    """native/build/libllmpipe_verify.so (built if stale), or None (no native build here)."""
    from pipeline.native import VERIFY_LIB, kernels_library_path
    try:
        return ctypes.CDLL(str(kernels_library_path(library=VERIFY_LIB)), mode=ctypes.RTLD_GLOBAL)
    except (OSError, RuntimeError):
        return None


@functools.cache
def _native_chain():
    """llmpipe_fma_chain of the kernel library, or None."""
    fn = getattr(_kernels_library(), "llmpipe_fma_chain", None)
    if fn is not None:
        fn.restype = None
        fn.argtypes = [ctypes.POINTER(ctypes.c_float)] * 3 + [ctypes.c_int64] * 3
    return fn


def dots_exact_in_fp32(group: int) -> bool:
    """A group's sum of products of activations (<= 255) and 16 w (|16 w| <= 128) stays below 2^24, where every fp32
    partial sum is an exact integer in any order (groups up to 512)."""
    return group * 255 * 128 < 2 ** 24


def runs_native_gemm() -> bool:
    """Whether this CPU runs the native 4-bit GEMM (AVX-512 VNNI); elsewhere the reference holds fp32 weights."""
    return {"avx512_vnni", "avx512bw"} <= cpu_flags()


@functools.cache
def _native_qb4w():
    """llmpipe_qb4w_gemm of the kernel library where this CPU runs it (AVX-512 VNNI, unsigned activations), or
    None: the whole 4-bit GEMM from packed 4-bit weights, an eighth of the fp32 path's memory and a fraction of its
    time."""
    if not runs_native_gemm():
        return None
    fn = getattr(_kernels_library(), "llmpipe_qb4w_gemm", None)
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    return fn


def bf16(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 to bf16 (nearest even, as torch's .to(bfloat16) in the serializer) and back."""
    return t.to(torch.bfloat16).float()


# --- the two GEMMs --------------------------------------------------------------------------------------------

def packed_ksum(w: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The qb4w packing's fp32 ksum per output channel: 0 - sum_chunk(ksum_chunk * bf16 scale), chunk by chunk."""
    n, k = w.shape
    chunks = w.reshape(n, k // KSUM_CHUNK, KSUM_CHUNK).sum(-1, dtype=torch.int64).float()  # no widened copy of w
    acc = torch.zeros(n)
    for c in range(k // KSUM_CHUNK):
        acc = acc - chunks[:, c] * scale[:, (c * KSUM_CHUNK) // group]
    return acc


def pack_nibbles(w: torch.Tensor) -> torch.Tensor:
    """int4 weights [cols][k] (cols % 16 == 0, k % 8 == 0) as llmpipe_qb4w_gemm reads them: per block of 16 columns
    and 8 inputs, 64 bytes, byte j holding column j / 4's w + 8 for inputs j % 4 (low nibble) and 4 + j % 4 (high)."""
    cols, k = w.shape
    u = (w.to(torch.int16) + 8).to(torch.uint8).reshape(cols // 16, 16, k // 8, 2, 4).permute(0, 2, 3, 1, 4)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).contiguous()         # [cols / 16][k / 8][16][4]


def block_scales(scale16: torch.Tensor) -> torch.Tensor:
    """Group scales [groups][cols] (bf16 values) as llmpipe_qb4w_gemm reads them: bf16 [cols / 16][groups][16]."""
    groups, cols = scale16.shape
    return scale16.to(torch.bfloat16).reshape(groups, cols // 16, 16).transpose(0, 1).contiguous()


class QB4WLinear(nn.Module):
    """qd8-f32-qb4w: int8 activations per row, int4 weights in groups with bf16 scales."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, bias, unsigned: bool = True, native: bool = True):
        super().__init__()
        k = qdata.shape[1]
        self.group = k // scale.shape[1]
        if self.group % KSUM_CHUNK or k % self.group:
            raise ValueError(f"group {self.group} of a {k}-wide qb4w linear")
        self.unsigned = unsigned
        s = bf16(scale.float())                                           # ExecuTorch serializes the scales as bf16
        n, self.in_features = qdata.shape
        self.out_features = n
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.native = native and unsigned and _native_qb4w() is not None
        # the native kernel takes 16 columns at a time: pad the columns (zero weights, scales and ksums)
        cols = -(-n // 16) * 16 if self.native else n
        pad = cols - n
        scale16 = F.pad(bf16(s / 16).T, (0, pad)).contiguous()          # [groups][cols] bf16(scale / 16): nibble << 4
        self.register_buffer("ksum", F.pad(packed_ksum(qdata, s, self.group), (0, pad)))
        if self.native:
            self.register_buffer("w4", pack_nibbles(F.pad(qdata.to(torch.int8), (0, 0, 0, pad))), persistent=False)
            self.register_buffer("scales", block_scales(scale16), persistent=False)
            return
        self.register_buffer("scale16", scale16)
        # [groups, group, out], for one batched exact dot product per call; wider groups sum in float64
        self.sum_dtype = torch.float32 if dots_exact_in_fp32(self.group) else torch.float64
        self.register_buffer("w16", (qdata.to(self.sum_dtype) * 16).reshape(n, k // self.group, self.group)
                             .permute(1, 2, 0).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k = x.shape, self.in_features
        x2 = x.reshape(-1, k).float()
        mult, dq, zp = row_qparams(x2, self.unsigned)
        a = quantize_rows(x2, mult, zp, self.unsigned)
        out = self.ksum[None, :] * zp.float()[:, None]                    # the running sum starts at ksum * zp
        if self.native:  # the dots and the chain in one pass over 4-bit weights (the same bits as below)
            a8 = a.to(torch.uint8).contiguous()
            if _native_qb4w()(a8.data_ptr(), a8.shape[0], k, self.w4.data_ptr(), out.shape[1], self.group,
                              self.scales.data_ptr(), out.data_ptr()) != 0:
                raise RuntimeError("llmpipe_qb4w_gemm refused its arguments")
            out = out[:, :self.out_features]
        else:
            out = self._dots_then_chain(a, out)
        out = out * dq[:, None]                                           # the row's scale after all groups
        if self.bias is not None:
            out = out + self.bias                                         # the bias last, a separate add
        return out.reshape(*shape[:-1], -1).to(x.dtype)

    def _dots_then_chain(self, a: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        groups = k // self.group
        # every group's exact int32 dot at once ([groups, rows, out]), then cvtdq2ps; the fp32 sum stays in order
        acc = torch.bmm(a.to(self.sum_dtype).reshape(-1, groups, self.group).transpose(0, 1), self.w16).float()
        return fma32_chain(acc, self.scale16, out)


class QC8WLinear(nn.Module):
    """qd8-f32-qc8w: int8 activations per row, int8 weights per output channel with fp32 scales."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, bias, unsigned: bool = True):
        super().__init__()
        self.unsigned = unsigned
        self.register_buffer("qdata", qdata.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.float().reshape(-1))          # fp32, as serialized
        b = torch.zeros_like(self.scale) if bias is None else bias.detach().float()
        self.register_buffer("bias_packed", b)                           # no bias: the packed bias is 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, k = x.shape, self.qdata.shape[1]
        x2 = x.reshape(-1, k).float()
        mult, dq, zp = row_qparams(x2, self.unsigned)
        a = quantize_rows(x2, mult, zp, self.unsigned)
        # int32 ksum * zp + dot = sum (q - zp) * w exactly; cvtdq2ps; times the row's scale; one fma
        acc = ((a - zp.double()[:, None]) @ self.qdata.double().T).float()
        out = fma32(acc * dq[:, None], self.scale[None, :], self.bias_packed[None, :])
        return out.reshape(*shape[:-1], -1).to(x.dtype)


# --- the swap -------------------------------------------------------------------------------------------------

def dynamic_weight(m: nn.Module):
    """The torchao weight of a dynamic-activation linear, or None."""
    w = getattr(m, "weight", None)
    if not isinstance(m, nn.Linear) or not all(hasattr(w, a) for a in ("qdata", "scale", "block_size")):
        return None
    return w if getattr(w, "activation_quantization", None) is not None else None


def xnnpack_linear(m: nn.Linear, unsigned: bool = True) -> nn.Module:
    """The XNNPACK form of one torchao dynamic-activation linear."""
    w = dynamic_weight(m)
    if w.block_size[0] != 1:
        raise ValueError(f"unsupported weight block size {w.block_size}")
    if w.zero_point is not None and bool((w.zero_point != 0).any()):
        raise ValueError("XNNPACK's dynamic linears take symmetric weights (zero points 0)")
    scale = w.scale.reshape(w.qdata.shape[0], -1)
    if w.target_dtype == torch.int4:       # ExecuTorch lowers 4-bit weights as qb4w, per channel = one group
        return QB4WLinear(w.qdata, scale, m.bias, unsigned)
    if scale.shape[1] != 1:
        raise ValueError("XNNPACK runs 8-bit weights under dynamic activations per output channel only")
    return QC8WLinear(w.qdata, scale[:, 0], m.bias, unsigned)


def reference(module: nn.Module, unsigned: bool | None = None, copy_first: bool = True) -> nn.Module:
    """A quantized wrapped module whose torchao dynamic-activation linears compute as XNNPACK's GEMMs do (qdu8
    activations where this CPU has VNNI, qd8 elsewhere; or as `unsigned` says): a deep copy, or with
    copy_first=False the module itself, converted."""
    from pipeline.model.layers.experts import pack_experts
    unsigned = unsigned_activations() if unsigned is None else unsigned
    ref = copy.deepcopy(module) if copy_first else module
    # a MoE layer's experts run in our kernel (llmpipe::experts): its twin computes what it computes
    if hasattr(ref, "model"):  # a wrapped module (not a bare linear)
        pack_experts(ref.model)
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if dynamic_weight(child) is not None:
                setattr(parent, name, xnnpack_linear(child, unsigned))
    return ref
