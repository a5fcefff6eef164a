"""backend=xnnpack: ExecuTorch's XNNPACK delegate, with the partitioner configs of weight_only.py (the stock
ones silently drop the scales of weight-only quantized linears)."""
from __future__ import annotations

import contextlib
import logging

from pipeline.config import v

RUNTIME = "executorch"
ASYMMETRIC_WEIGHTS = False  # its int weights are symmetric (a zero point would be dropped)
NATIVE_RUNNER = True
from pipeline.model.quant.schemes import SCHEMES, refused_by

# the weight-only schemes (int weights, float activations) by their bits
WEIGHT_ONLY_BITS = {name: s.bits for name, s in SCHEMES.items() if s.weight_only}
# the transformers exporter's route builds a stock XnnpackPartitioner(), which leaves bf16 matmuls outside the
# delegate on portable kernels (our own partitioner enables bf16: weight_only.partitioner)
HANDOVER_DTYPES = ("fp32", "fp16")
HANDOVER_DTYPES_WHY = ("its stock XNNPACK partitioner leaves bf16 matmuls outside the delegate; export.exporter=native "
                       "delegates them")
KV_STORAGES = ("fp32", "fp16", "bf16", "int8", "int4")  # our off-graph caches (native/src/kernels/offgraph_cache.h)
KV_STORAGES_WHY = ""
# a half-precision program with matmuls outside the delegate runs them on portable kernels (~100x slower): refused
DELEGATES_MATMULS = True
# lower may take the exported program export holds in memory (pipeline/exporters/handoff.py): the same bytes, held by
# tests/exporters/test_handoff.py
LOWERS_PROGRAM_IN_MEMORY = True
# lowers a non-strict exported program (export.strict: null): the same program bits, about half the export time
LOWERS_NON_STRICT = True
TAIL_LOGITS = True
# an adapter kept apart (model.adapter_mode=separate): its delegate reads the base's constants from foundation.ptd
ADAPTER_APART_WHY = ""
# its file keeps 4-bit group scales in bf16 and per-row scales in fp32 (bits per group, per row)
SCALE_BITS = (16, 32)
# what quantize.target_bpw may give a linear here, cheapest first (group 0: one scale per row)
PLAN_CANDIDATES = (("8da4w", 0), ("8da4w", 32), ("8da8w", 0))
HANDOVER_CACHE = "StaticCache"  # the cache the transformers exporter passes through its programs
HANDOVER_CACHE_WHY = ""

log = logging.getLogger(__name__)


def refuses(scheme: str, group: int, dtype: str = "fp32", gemm: bool = True) -> str | None:
    """Why this backend cannot build a quantization scheme at this export.dtype (None: it can); gemm: a linear's
    weight (an embedding's is only gathered)."""
    if refused_by(scheme, "xnnpack"):
        return refused_by(scheme, "xnnpack")
    if scheme == "8da4w" and group % 32:
        return ("XNNPACK's blockwise 4-bit weights take groups of a multiple of 32 (its serializer asserts it): "
                "group size 0, 32, 64, ...")
    if gemm and dtype != "fp32" and scheme in WEIGHT_ONLY_BITS and group == 0:
        return (f"its per-channel weight-only linears (f32-qc4w, f32-qc8w) take fp32 activations only: at {dtype} "
                f"they fall outside the delegate. Use 8da4w, or export.dtype=fp32")
    if gemm and dtype == "bf16" and scheme in WEIGHT_ONLY_BITS:
        return ("its group-wise weight-only linears run on the portable mixed_linear kernel, which has no bf16 form "
                "(the program fails at run time with error 0x12). Use 8da4w, export.dtype=fp16, or fp32")
    if gemm and dtype == "bf16" and scheme == "8da8w":
        return ("its int8-weight GEMM under dynamic activations (qd8-f32-qc8w) has no bf16 form: the program fails "
                "to load with xnn_status_invalid_parameter. With export.dtype=bf16 use 8da4w or none; or fp16")
    if scheme == "8da8w" and group > 0:
        return ("XNNPACK runs int8 weights under dynamic activations per output channel only (qd8-f32-qc8w; "
                "lowering stops at 'Only 4b group quantization is supported'): group size 0")
    return None


def refuses_cache(mode: str, flags: dict) -> str | None:
    """Why this backend cannot build a cache mode with these custom-op flags (None: it can): it runs them all (a stock
    program's llama:: ops on ExecuTorch's kernels in Python, on native/'s twins in our runners)."""
    return None


def refuses_kv_dtype() -> str | None:
    """Why cache.kv_dtype cannot set the in-graph cache's storage here (None: the fused op converts on write)."""
    return None


def refuses_arch(arch) -> str | None:
    """Why it cannot build a model of this architecture (None: what XNNPACK leaves, our kernels and the portable
    ones run: the experts' llmpipe::experts, attention sinks in the cache modes' ops)."""
    return None


def setup() -> None:
    pass


def pack_experts(model) -> int:
    """A MoE layer's experts as one llmpipe::experts op (pipeline/model/layers/experts.py): XNNPACK has no kernel that
    runs only the rows routed to each expert; returns how many layers."""
    from pipeline.model.layers.experts import pack_experts as ours
    return ours(model)


def prepare(module, cfg) -> dict:
    """Weight-only linears in the forms XNNPACK (or the portable kernels) run correctly."""
    bits = WEIGHT_ONLY_BITS.get(v(cfg.quantize.linear))
    if bits is None:
        return {}
    from pipeline.backends.xnnpack.weight_only import prepare_weight_only_linears
    info = prepare_weight_only_linears(module.model, bits)
    if info["mixed_linear"]:
        log.warning("%d group-wise weight-only linears run on the portable mixed_linear kernel "
                    "(XNNPACK has none for fp32 x group-wise int weights): correct but slow; "
                    "quantize.linear_group_size=0 puts them on XNNPACK", info["mixed_linear"])
    return info


def partition():
    from pipeline.backends.xnnpack.glue import delegable_glue
    from pipeline.backends.xnnpack.weight_only import partitioner, split_weight_only_linear_bias
    return [partitioner()], [split_weight_only_linear_bias, delegable_glue]


@contextlib.contextmanager
def lowering():
    """Partitioning without look-ups that grow with the square of the graph (lean_partition.py), preprocess without the
    XNNPACK passes that cannot change a partition (lean_preprocess.py)."""
    from pipeline.backends.xnnpack.lean_partition import lean_partition
    from pipeline.backends.xnnpack.lean_preprocess import lean_preprocess
    with lean_partition(), lean_preprocess() as stats:
        yield stats


def executorch_config(cfg):
    from executorch.exir import ExecutorchBackendConfig
    return ExecutorchBackendConfig(run_reinplace_pass=True, do_quant_fusion_and_const_prop=cfg.backend.quant_fusion)


def handover(model, q) -> dict:
    from pipeline.backends.xnnpack import transformers_route
    return transformers_route.handover(model, q)


def reference(module):
    """The eager module that computes what this backend's program computes: the module itself, its dynamic-activation
    linears converted in place to XNNPACK's GEMMs (numerics.py; verify loads a module for it, so no copy is held)."""
    from pipeline.backends.xnnpack import numerics
    if not any(numerics.dynamic_weight(m) is not None for m in module.modules()):
        return module
    return numerics.reference(module, copy_first=False)


def reference_extra_bytes(scheme: str, group: int) -> int:
    """Bytes a linear weight of `scheme` costs the reference beyond its native path (preflight's verify estimate):
    for 8da4w where this CPU lacks the native 4-bit GEMM, fp32 weights instead of int8 (3), float64 where a group's
    dot outgrows fp32's exact integers (7: per channel, or groups wider than 512)."""
    from pipeline.backends.xnnpack import numerics
    if scheme != "8da4w" or numerics.runs_native_gemm():
        return 0
    return 3 if group and numerics.dots_exact_in_fp32(group) else 7


def cross_check_runtime(mode) -> None:
    return None
