"""backend=mlx: ExecuTorch's MLX delegate (Apple GPUs), built here on Linux and checked with our interpreter of
its payload (pipeline/runtimes/mlx).

The cache modes' wrappers keep their layout; only the attention op they call is switched to the one the MLX
delegate lowers (attention.py), and the recurrent layers' conv and delta rule to theirs (recurrent.py). Lowering
uses the delegate's default passes and the compile config of its LLM example (extract_delegate_segments, graph
inputs planned).
"""
from __future__ import annotations

import contextlib

from pipeline.config import v

RUNTIME = "mlx"           # no MLX runtime on Linux: our interpreter of the delegate payload
ASYMMETRIC_WEIGHTS = True   # affine quantized matmul: scale + bias per group
HANDOVER_DTYPES = ("fp32", "fp16", "bf16")  # dtypes the transformers exporter's route takes
HANDOVER_DTYPES_WHY = ""
KV_STORAGES = ("fp32", "fp16", "bf16")
KV_STORAGES_WHY = ("int8 and int4 rows are our caches' (the C++ runners', the Python runtime's); on a Mac the MLX "
                   "runtime's own off-graph cache stores K/V in a float type")
DELEGATES_MATMULS = True  # lower refuses a half-precision program with matmuls outside the delegate
NATIVE_RUNNER = False     # the C++ runners link XNNPACK and the portable kernels, not the MLX delegate
# an in-memory exported program still carries torchao tensor subclasses in its nodes' values, which MLX's lowering
# cannot type (loaded from program.pt2 they are plain tensors): it loads the file
LOWERS_PROGRAM_IN_MEMORY = False
LOWERS_NON_STRICT = False  # the same: a non-strict program's values are the tensor subclasses (found by CI)
ADAPTER_APART_WHY = ("its delegate's payload holds the program's weights (no foundation.ptd here): merge the adapter "
                     "(model.adapter_mode=merge)")
TAIL_LOGITS = False  # its lowering cannot take the symbolic min(T, K) rows (sym_min of a delegate's output)
SCALE_BITS = (32, 32)  # an fp16 scale and an fp16 bias per group
PLAN_CANDIDATES = (("4w", 64), ("4w", 32), ("8w", 64), ("8w", 32))
HANDOVER_CACHE = "DynamicCache"
HANDOVER_CACHE_WHY = ""


def refuses(scheme: str, group: int, dtype: str = "fp32", gemm: bool = True) -> str | None:
    """Why this backend cannot build a quantization scheme at this export.dtype (None: it can); gemm: a linear's
    weight (an embedding's is only gathered)."""
    from pipeline.model.quant.schemes import refused_by
    return refused_by(scheme, "mlx")


def refuses_cache(mode: str, flags: dict) -> str | None:
    """Why this backend cannot build a cache mode with these custom-op flags (None: it can): it builds every
    combination a mode declares (attention.py). With cache.mode=custom, both flags are mlx::kv_cache_update +
    mlx::custom_sdpa; custom_sdpa alone, HF's StaticCache (index_copy_) + mlx::custom_sdpa; custom_kv_cache alone,
    mlx::kv_cache_update + aten SDPA under an explicit mask. Not a mode built on ExecuTorch's LLM ops (stock)."""
    from pipeline.model.cache_modes import CACHE_MODES
    if CACHE_MODES[mode].EXECUTORCH_OPS_ONLY:
        return ("its programs call ExecuTorch's LLM custom ops (llama::update_cache, llama::custom_sdpa), which the MLX "
                "delegate does not lower and the MLX runtime does not run; MLX has its own cache ops: cache.mode=custom "
                "or offgraph")
    allowed = CACHE_MODES[mode].FLAGS
    if flags not in allowed:
        return (f"allowed [custom_sdpa, custom_kv_cache]: "
                f"{[[f['custom_sdpa'], f['custom_kv_cache']] for f in allowed]}")
    return None


def refuses_kv_dtype() -> str | None:
    return "MLX's cache ops (mlx::kv_cache_update, mlx::custom_sdpa) keep the activation dtype"


def refuses_arch(arch) -> str | None:
    """Why it cannot build a model of this architecture (None: it can). A program must be MLX delegate calls only
    (the MLX runtime runs nothing else): attention sinks have no MLX form (the delegate's SDPA node takes no sink
    logits); experts run as gather matmuls (experts.py) under silu or relu^2 only; recurrent layers keep their state
    in the program's buffers in every mode (recurrent.py)."""
    if arch.attention.sinks:
        return "attention sinks: the MLX delegate's SDPA node takes no sink logits"
    if arch.experts is not None and arch.experts.activation not in ("silu", "relu2"):
        return (f"experts with a {arch.experts.activation} activation: MLX's gather matmuls run silu(gate) * up or "
                "relu(up)^2 here")
    return None


def setup() -> None:
    from pipeline.backends.mlx import gather, schema
    schema.ensure()  # the wheel lacks the generated schema modules until this runs once
    import executorch.backends.mlx  # noqa: F401  (registers mlx:: ops)
    import executorch.backends.mlx.custom_ops  # noqa: F401
    from executorch.extension.llm.cache import update_and_attend  # noqa: F401  (kvcache:: op)
    gather.register()  # routers that gather their top-k scores (gather.py)


def prepare(module, cfg) -> dict:
    """Switch a wrapped module's attention and recurrent layers to the ops the MLX delegate lowers, before
    torch.export."""
    setup()
    from pipeline.backends.mlx.attention import prepare_attention
    from pipeline.backends.mlx.recurrent import prepare_recurrent
    from pipeline.model.cache_modes import flags
    return {**prepare_attention(module, v(cfg.cache.mode), cfg.export.max_context_len, flags(cfg.cache)),
            **prepare_recurrent(module)}


def pack_experts(model) -> int:
    """A MoE layer's experts as gather matmuls the delegate lowers (experts.py); returns how many layers."""
    setup()
    from pipeline.backends.mlx.experts import gather_experts
    return gather_experts(model)


def partition():
    setup()
    from executorch.backends.mlx import MLXPartitioner
    from executorch.backends.mlx.passes import get_default_passes
    return [MLXPartitioner()], get_default_passes()


def lowering():
    return contextlib.nullcontext()


def executorch_config(cfg):
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    return ExecutorchBackendConfig(extract_delegate_segments=True,
                                   memory_planning_pass=MemoryPlanningPass(alloc_graph_input=True))


def handover(model, q) -> dict:
    """Nothing to rewrite: the MLX partitioner lowers torchao's tensors as they are."""
    from torch import nn
    n = sum(hasattr(m.weight, "qdata") for m in model.modules() if isinstance(m, nn.Linear))
    done = {"linear_forms": {"torchao tensors (MLX QuantizedMatmulNode)": n} if n else {}}
    if v(q.embedding) != "none":
        done["embedding_form"] = "torchao tensor (MLX DequantizeNode + TakeNode)"
    return done


def reference(module):
    """The eager module that computes what this backend's program computes: torchao's own forms at fp32; at half
    precision MLX's affine weights, accumulated in fp32 (numerics.py), converted in place (verify loads a module for
    it, so no copy is held)."""
    from pipeline.backends.mlx import numerics
    return numerics.reference(module, next(module.parameters()).dtype, copy_first=False)


def reference_extra_bytes(scheme: str, group: int) -> int:
    return 0  # the reference converts in place, in the module's own weights


def cross_check_runtime(mode) -> str | None:
    """On a Mac (ExecuTorch with MLXBackend registered) verify also runs the real runtime. Not for a runtime-owned
    cache: the MLX runner installs that one, the Python runtime cannot."""
    from pipeline.model.cache_modes import CACHE_MODES
    if CACHE_MODES[mode].RUNTIME_OWNED:
        return None
    from executorch.runtime import Runtime
    return "executorch" if Runtime.get().backend_registry.is_available("MLXBackend") else None
