"""What every cache-mode module declares (checked when pipeline/model/cache_modes is imported)."""
from __future__ import annotations

from typing import Optional, Protocol


class CacheMode(Protocol):
    FLAGS: tuple                # the cache.custom_sdpa / cache.custom_kv_cache combinations it takes, its default first
    FLAGS_WHY: str              # why those
    RUNTIME_OWNED: bool         # the runtime owns the cache (sized per run: verify.runtime, the runners' --kv-*)
    KERNELS: tuple              # native kernel libraries its programs call ("llmpipe": native/'s; "llama": ExecuTorch's
                                # LLM custom ops, pipeline/ops.py)
    EXECUTORCH_OPS_ONLY: bool   # its programs call ExecuTorch's operators alone: export adds none of ours
    LOGITS_MODES: tuple         # the export.logits_mode values it exports (`selected`: forward takes rows Long[R])

    def rings(self, flags: dict) -> bool:
        """Sliding layers hold window + chunk - 1 slots instead of the whole context."""

    def exports_non_strict(self, flags: dict) -> bool:
        """Its module exports non-strict to a program that lowers (export.strict: null)."""

    def takes_rows(self, flags: dict) -> bool:
        """Its module takes the rows input (export.logits_mode=auto is `tail` or `selected` there)."""

    def sdpa_with_kv_cache(self, flags: dict) -> bool:
        """Attention is one custom op over the cache (ExecuTorch's runner metadata)."""

    def kv_dtype_refused(self, flags: dict) -> Optional[str]:
        """Why it cannot store its K/V as cache.kv_dtype says (None: it can)."""

    def refuses_arch(self, arch, flags: dict) -> Optional[str]:
        """Why it cannot build a model of this architecture's entry, or None."""

    def wrap(self, model, context: int, logits_mode: str, chunk: int, flags: dict, kv_dtype=None):
        """The runner-layout module, (tokens, positions) -> logits (kv_dtype: a torch dtype for the K/V, or None)."""

    def constant_methods(self, cfg, context: int, chunk: int, flags: dict) -> dict:
        """The constant methods the mode adds to the .pte."""
