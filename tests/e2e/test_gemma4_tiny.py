"""Every tiny Gemma 4 config in every cache mode, on xnnpack and mlx, 4w as the reference validates Gemma 4:
built and verified (the exact gate against the same-quant eager model; on xnnpack the C++ runner equals the
Python runtime; on mlx our interpreter of the delegate payload runs it). cache=custom also takes each custom-op
flag alone (custom_sdpa: HF's StaticCache + the attention op; custom_kv_cache: the cache-update op + the attention
math), the KV-shared layers reading their source's cache. Slow tier: 20 builds of about 2 min each.

    python -m pytest -q -m slow tests/e2e/test_gemma4_tiny.py
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import build

ROTATE_EACH_TEST = True  # 20 builds of their own: the slow tier's rotation takes them one by one

RECIPES = {("xnnpack", "static"): "tiny_gemma4_xnnpack", ("xnnpack", "custom"): "tiny_gemma4_custom",
           ("xnnpack", "custom_sdpa"): "tiny_gemma4_custom", ("xnnpack", "custom_kv_cache"): "tiny_gemma4_custom",
           ("xnnpack", "offgraph"): "tiny_gemma4_offgraph", ("mlx", "static"): "tiny_gemma4_mlx_offgraph",
           ("mlx", "custom"): "tiny_gemma4_mlx_4w", ("mlx", "custom_sdpa"): "tiny_gemma4_mlx_4w",
           ("mlx", "custom_kv_cache"): "tiny_gemma4_mlx_4w", ("mlx", "offgraph"): "tiny_gemma4_mlx_offgraph"}
# mode -> the cache overrides (custom: both flags, the default)
CACHE = {"static": ("cache=static",), "custom": ("cache=custom",),
         "custom_sdpa": ("cache=custom", "cache.custom_kv_cache=false"),
         "custom_kv_cache": ("cache=custom", "cache.custom_sdpa=false"), "offgraph": ("cache=offgraph",)}
# the custom ops a flag alone leaves in the xnnpack program (the other half is HF's / the graph's)
SPLIT_OPS = {"custom_sdpa": ("llmpipe::sdpa", "llmpipe::update_cache"),
             "custom_kv_cache": ("llmpipe::update_cache", "llmpipe::sdpa")}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xnnpack", "mlx"])
@pytest.mark.parametrize("mode", list(CACHE))
@pytest.mark.parametrize("model", ["tiny_gemma4", "tiny_gemma4_keqv"])
def test_tiny_gemma4_builds_verify(model, mode, backend):
    recipe = RECIPES[backend, mode]
    m = build(recipe, f"model={model}", *CACHE[mode])
    assert m["status"] == "ok"
    v = m["verify"]
    assert v["gate"] == "exact" and v["same_quant"]["greedy_match"] == v["same_quant"]["greedy_total"], v
    assert v["same_quant"]["max_logit_err"] < 1e-3, v
    if backend == "xnnpack":
        assert v["native"]["token_parity"] is True
        if mode == "offgraph":  # one cache entry per layer that computes K/V
            shared = ", 2 shared" if model == "tiny_gemma4" else ""
            assert v["native"]["cache_report"].endswith(shared or "ring(window 16)"), v["native"]
        if mode in SPLIT_OPS:
            _has_only(m, *SPLIT_OPS[mode])
    if backend == "mlx":  # tiny_gemma4_mlx_4w stands for gemma4_mlx_4w (tests/backends/test_mlx.py: tiny twins)
        from pipeline.runtimes.mlx import ops
        from pipeline.runtimes.mlx.program import MLXProgram
        uncovered = [op for op in MLXProgram(m["pte"]).ops() if not ops.Interpreter.covers(op)]
        assert not uncovered, f"instructions without an interpreter handler: {uncovered}"


def _has_only(m, present: str, absent: str) -> None:
    """The .pte's operator table names one half of cache=custom and not the other."""
    data = Path(m["pte"]).read_bytes()
    assert present.encode() in data and absent.encode() not in data, (present, absent)
