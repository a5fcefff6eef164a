"""backend=portable: no delegate; every op runs on ExecuTorch's portable (and quantized) CPU kernels."""
from __future__ import annotations

import contextlib

RUNTIME = "executorch"
ASYMMETRIC_WEIGHTS = False  # kept simple: the schemes it runs are symmetric
HANDOVER_DTYPES = ("fp32", "fp16", "bf16")  # dtypes the transformers exporter's route takes
HANDOVER_DTYPES_WHY = ""
KV_STORAGES = ("fp32", "fp16", "bf16", "int8", "int4")  # our off-graph caches (native/src/kernels/offgraph_cache.h)
KV_STORAGES_WHY = ""
DELEGATES_MATMULS = False  # lower refuses a half-precision program with matmuls outside the delegate
NATIVE_RUNNER = True
LOWERS_PROGRAM_IN_MEMORY = False  # not held to the bytes of the file: it loads program.pt2
LOWERS_NON_STRICT = False  # not measured
TAIL_LOGITS = True
ADAPTER_APART_WHY = ""  # its constants go to foundation.ptd as any program's may
SCALE_BITS = (16, 32)  # as XNNPACK's: the same torchao layouts
PLAN_CANDIDATES = (("8da4w", 0), ("8da4w", 32), ("8da8w", 0))
HANDOVER_CACHE = None
HANDOVER_CACHE_WHY = "the exporter has no portable backend (its backends: xnnpack, cuda, mlx)"


def refuses(scheme: str, group: int, dtype: str = "fp32", gemm: bool = True) -> str | None:
    """Why this backend cannot build a quantization scheme at this export.dtype (None: it can); gemm: a linear's
    weight (an embedding's is only gathered)."""
    from pipeline.model.quant.schemes import refused_by
    return refused_by(scheme, "portable")


def refuses_cache(mode: str, flags: dict) -> str | None:
    """Why this backend cannot build a cache mode with these custom-op flags (None: it can): it runs them all (a stock
    program's llama:: ops on ExecuTorch's kernels in Python, on native/'s twins in our runners)."""
    return None


def refuses_kv_dtype() -> str | None:
    """Why cache.kv_dtype cannot set the in-graph cache's storage here (None: the fused op converts on write)."""
    return None


def refuses_arch(arch) -> str | None:
    """Why it cannot build a model of this architecture (None: every op outside a delegate runs here)."""
    return None


def setup() -> None:
    pass


def prepare(module, cfg) -> dict:
    return {}


def pack_experts(model) -> int:
    """A MoE layer's experts as one llmpipe::experts op (pipeline/model/layers/experts.py); returns how many layers."""
    from pipeline.model.layers.experts import pack_experts as ours
    return ours(model)


def partition():
    return [], []


def lowering():
    return contextlib.nullcontext()


def executorch_config(cfg):
    from executorch.exir import ExecutorchBackendConfig
    return ExecutorchBackendConfig(run_reinplace_pass=True, do_quant_fusion_and_const_prop=cfg.backend.quant_fusion)


def handover(model, q) -> dict:
    raise NotImplementedError("the transformers exporter has no portable backend")


def reference(module):
    """The eager module that computes what this backend's program computes: torchao's own forms do."""
    return module


def reference_extra_bytes(scheme: str, group: int) -> int:
    return 0  # the reference is the module itself


def cross_check_runtime(mode) -> None:
    return None
