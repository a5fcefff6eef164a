"""The backends, one module (or package) each; the file name is the `backend.name` value.

Each declares:
    RUNTIME: str             -- the runtime that runs its programs here (pipeline/runtimes/<RUNTIME>)
    NATIVE_RUNNER: bool      -- the C++ runners (native/) run its programs
    HANDOVER_DTYPES: tuple   -- export.dtype values the transformers exporter's route builds well (and _WHY, why not others)
    DELEGATES_MATMULS: bool  -- lower refuses a half-precision program whose matmuls fall outside its delegate
    ASYMMETRIC_WEIGHTS: bool -- its quantized weights keep a zero point (quantize.source_grid carries Q4_1 there)
    LOWERS_PROGRAM_IN_MEMORY: bool -- lower may take the program export holds in memory (pipeline/exporters/handoff.py)
    LOWERS_NON_STRICT: bool  -- it lowers a non-strict exported program (export.strict: null, fp32)
    TAIL_LOGITS: bool        -- it lowers logits mode `tail` (a symbolic min(T, K) rows; export.logits_mode=auto
                                picks `selected` where it does not)
    refuses(scheme, group, dtype, gemm) -- why this backend cannot build a quantization scheme at that
                                export.dtype (gemm: a linear's weight), or None (preflight asks)
    refuses_cache(mode, flags) -- why it cannot build a cache mode with these custom-op flags, or None
    refuses_kv_dtype()       -- why it cannot store an in-graph cache as cache.kv_dtype says, or None
    refuses_arch(arch)       -- why it cannot build a model of this architecture's entry (pipeline/model/archs), or None
    setup()                  -- register the ops its programs and its lowering need
    pack_experts(model)      -- a MoE model's expert banks in the form its programs run, before prepare; how many
    prepare(module, cfg)     -- module rewrites before torch.export (native route); returns a report
    partition()              -- (partitioners, transform passes) for to_edge_transform_and_lower
    lowering()               -- a context manager around that lowering (XNNPACK: its lean preprocess)
    executorch_config(cfg)   -- the ExecutorchBackendConfig of to_executorch
    handover(model, q)       -- the forms its lowering gets right, for the transformers exporter's route
    reference(module)        -- the eager module that computes what its programs compute (verify's same-quant
                                reference; XNNPACK's dynamic linears differ from torchao's emulation)
    reference_extra_bytes(scheme, group) -- bytes a linear weight costs that reference on this CPU beyond what the
                                native path holds (preflight's verify estimate)
    cross_check_runtime(mode) -- another runtime verify also compares against, when this machine has one
"""
from __future__ import annotations

from pipeline.backends import mlx, portable, xnnpack
from pipeline.model import cache_modes
from pipeline.registry import Registry

BACKENDS = Registry("backend.name", {m.__name__.rsplit(".", 1)[-1]: m for m in (xnnpack, portable, mlx)})


def logits_mode(cfg) -> str:
    """export.logits_mode as built (pipeline/model/cache_modes logits_mode), `tail` only where the backend lowers it."""
    return cache_modes.logits_mode(cfg, tail=BACKENDS[cfg.backend.name].TAIL_LOGITS)
