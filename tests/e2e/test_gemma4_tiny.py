"""Every tiny Gemma 4 config in every cache mode, on xnnpack and mlx, 4w as the reference validates Gemma 4:
built and verified (the exact gate against the same-quant eager model; on xnnpack the C++ runner equals the
Python runtime; on mlx our interpreter of the delegate payload runs it). Slow tier: 12 builds of about 2 min each.

    python -m pytest -q -m slow tests/e2e/test_gemma4_tiny.py
"""
from __future__ import annotations

import pytest

from tests.helpers import build

RECIPES = {("xnnpack", "static"): "tiny_gemma4_xnnpack", ("xnnpack", "custom"): "tiny_gemma4_custom",
           ("xnnpack", "offgraph"): "tiny_gemma4_offgraph", ("mlx", "static"): "tiny_gemma4_mlx_offgraph",
           ("mlx", "custom"): "tiny_gemma4_mlx_4w", ("mlx", "offgraph"): "tiny_gemma4_mlx_offgraph"}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xnnpack", "mlx"])
@pytest.mark.parametrize("mode", ["static", "custom", "offgraph"])
@pytest.mark.parametrize("model", ["tiny_gemma4", "tiny_gemma4_keqv"])
def test_tiny_gemma4_builds_verify(model, mode, backend):
    recipe = RECIPES[backend, mode]
    m = build(recipe, f"model={model}", f"cache={mode}")
    assert m["status"] == "ok"
    v = m["verify"]
    assert v["gate"] == "exact" and v["same_quant"]["greedy_match"] == v["same_quant"]["greedy_total"], v
    assert v["same_quant"]["max_logit_err"] < 1e-3, v
    if backend == "xnnpack":
        assert v["native"]["token_parity"] is True
        if mode == "offgraph":  # one cache entry per layer that computes K/V
            shared = ", 2 shared" if model == "tiny_gemma4" else ""
            assert v["native"]["cache_report"].endswith(shared or "ring(window 16)"), v["native"]
    if backend == "mlx":  # tiny_gemma4_mlx_4w stands for gemma4_mlx_4w (tests/backends/test_mlx.py: tiny twins)
        from pipeline.runtimes.mlx import ops
        from pipeline.runtimes.mlx.program import MLXProgram
        uncovered = [op for op in MLXProgram(m["pte"]).ops() if not ops.Interpreter.covers(op)]
        assert not uncovered, f"instructions without an interpreter handler: {uncovered}"
