"""What every backend module declares (checked when pipeline/backends is imported)."""
from __future__ import annotations

from typing import Optional, Protocol


class Backend(Protocol):
    RUNTIME: str                    # the runtime that runs its programs here (pipeline/runtimes/<RUNTIME>)
    NATIVE_RUNNER: bool             # the C++ runners (native/) run its programs
    HANDOVER_DTYPES: tuple          # export.dtype values the transformers exporter's route builds well
    HANDOVER_DTYPES_WHY: str        # why not the others
    HANDOVER_CACHE: Optional[str]   # the HF cache that route passes through its programs; None: no such route
    HANDOVER_CACHE_WHY: str         # why there is none
    DELEGATES_MATMULS: bool         # lower refuses a half-precision program whose matmuls fall outside its delegate
    ASYMMETRIC_WEIGHTS: bool        # its quantized weights keep a zero point (quantize.source_grid carries Q4_1 there)
    LOWERS_PROGRAM_IN_MEMORY: bool  # lower may take the program export holds in memory (exporters/handoff.py)
    LOWERS_NON_STRICT: bool         # it lowers a non-strict exported program (export.strict: null, fp32)
    TAIL_LOGITS: bool               # it lowers logits mode `tail` (export.logits_mode=auto picks `selected` elsewhere)
    ADAPTER_APART_WHY: str          # why it cannot keep an adapter apart (model.adapter_mode=separate); "": it can
    SCALE_BITS: tuple               # bits of scale (and bias) its file keeps per group, and per row
    PLAN_CANDIDATES: tuple          # (scheme, group) quantize.target_bpw may give a linear, cheapest first
    KV_STORAGES: tuple              # verify.runtime.kv_storage_dtype values its off-graph programs' runtimes store
    KV_STORAGES_WHY: str            # why not the others

    def refuses(self, scheme: str, group: int, dtype: str = "fp32", gemm: bool = True) -> Optional[str]:
        """Why it cannot build a quantization scheme at that export.dtype (gemm: a linear's weight), or None."""

    def refuses_cache(self, mode: str, flags: dict) -> Optional[str]:
        """Why it cannot build a cache mode with these custom-op flags, or None."""

    def refuses_kv_dtype(self) -> Optional[str]:
        """Why it cannot store an in-graph cache as cache.kv_dtype says, or None."""

    def refuses_arch(self, arch) -> Optional[str]:
        """Why it cannot build a model of this architecture's entry (pipeline/model/archs), or None."""

    def setup(self) -> None:
        """Registers the ops its programs and its lowering need."""

    def pack_experts(self, model) -> int:
        """A MoE model's expert banks in the form its programs run, before prepare; how many."""

    def prepare(self, module, cfg) -> dict:
        """Module rewrites before torch.export (native route); a report."""

    def partition(self):
        """(partitioners, transform passes) for to_edge_transform_and_lower."""

    def lowering(self):
        """A context manager around that lowering (XNNPACK: its lean partitioning and preprocess)."""

    def executorch_config(self, cfg):
        """The ExecutorchBackendConfig of to_executorch."""

    def handover(self, model, q) -> dict:
        """The forms its lowering gets right, for the transformers exporter's route."""

    def reference(self, module):
        """The eager module that computes what its programs compute (verify's same-quant reference)."""

    def reference_extra_bytes(self, scheme: str, group: int) -> int:
        """Bytes a linear weight costs that reference beyond what the native path holds (preflight's estimate)."""

    def cross_check_runtime(self, mode):
        """Another runtime verify also compares against, when this machine has one (None: none)."""
