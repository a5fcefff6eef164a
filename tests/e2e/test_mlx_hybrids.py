"""The recurrent hybrids on MLX (pipeline/backends/mlx/recurrent.py): tiny Qwen3.5 and LFM2 programs are delegate
calls only, verified at the exact gate through the interpreter, with each form the delegate gives the delta rule: a
ScanNode over the step's tokens (key dim 16) and its Metal kernel `gated_delta_step` (key dim 32), and the conv as
Conv1DNode. (Every family x mode x scheme cell is in the slow tier: tests/e2e/test_families.py.)

The Metal kernel's source never runs here (no Apple GPU): the interpreter looks the node up by its kernel name and runs
its own recurrence for it (pipeline/runtimes/mlx/recurrent_ops.py). That case proves the program's wiring around the
node (its inputs, outputs and state), not the kernel's Metal code."""
from __future__ import annotations

import pytest

from pipeline.runtimes.mlx.program import coverage
from tests.e2e.test_families import build_family


@pytest.mark.parametrize("family,mode,extra,node", [
    ("qwen3_5_text", "custom", [], "ScanNode"),
    ("qwen3_5_text", "offgraph", ["model.random.linear_head_dim=32"], "MetalKernelNode"),
    ("lfm2", "custom", [], "Conv1DNode"),
], ids=["qwen3_5-custom-scan", "qwen3_5-offgraph-metal-node-by-name-not-its-source", "lfm2-custom"])
def test_a_hybrid_builds_on_mlx_and_verifies_exactly(family, mode, extra, node):
    """Exact through the interpreter; for MetalKernelNode that is our recurrence in the kernel's place (see above)."""
    m = build_family(family, "mlx", mode, "fp32", *extra)
    assert m["status"] == "ok", m.get("error")
    assert m["verify"]["gate"] == "exact"
    cov = coverage(m["pte"])
    assert node in cov["instructions"] and cov["uncovered"] == []
    assert "Conv1DNode" in cov["instructions"]
