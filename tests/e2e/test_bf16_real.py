"""bf16 end to end on the real models (slow tier: four real builds of 5 to 10 minutes each; CI builds half
precision on tiny models, tests/stages/test_half_precision.py and tests/backends/test_mlx.py): SmolLM2 and gemma3 on
XNNPACK with every matmul inside the delegate, and the MLX example's two commands at its default dtype through the
interpreter. Each is held to its gate against bf16 eager (8da4w: `dynamic`; float: `half`), relative to the build's
own bf16 numerics floor, and answers the France prompt."""
from __future__ import annotations

import json

import pytest

from pipeline.exporters.native import MATMUL_OPS
from tests.helpers import build_cli, stage_path

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
ROTATE_EACH_TEST = True  # four builds of their own: four heavy units of the slow tier's rotation

BUILDS = {
    "smollm2 xnnpack 8da4w": (("smollm2_custom", "export.dtype=bf16"), "dynamic"),
    "gemma3 xnnpack 8da4w off-graph": (("gemma3_offgraph_8da4w", "export.dtype=bf16"), "dynamic"),
    "smollm2 mlx (llama_mlx_bf16)": (("llama_mlx_bf16",), "half"),
    "gemma3 mlx off-graph (gemma3_mlx_offgraph_bf16)": (("gemma3_mlx_offgraph_bf16",), "half"),
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_a_real_bf16_build_verifies_with_its_matmuls_delegated(name):
    args, gate = BUILDS[name]
    m = build_cli(*args)
    assert m["status"] == "ok" and m["config"]["export"]["dtype"] == "bf16"
    lower = next(s for s in m["stages"] if s["name"] == "lower")["metrics"]
    outside = {op: c["non_delegated"] for op, c in lower["delegation_by_op"].items()
               if op in MATMUL_OPS and c["non_delegated"]}
    assert not outside, outside
    v = m["verify"]
    assert v["gate"] == gate
    assert v["same_quant"]["kld"] <= 1.5 * v["floor"]["kld"]
    report = json.loads((stage_path(m, "verify") / "report.json").read_text())
    assert report["passed"]
    france = report["prompts"][0]
    assert "capital of France" in france["prompt"]
    if "Paris" in france["reference_text"]:
        assert "Paris" in france["pte_text"]
    else:  # 8da4w at bf16 moved the eager model itself off the answer (gemma3: KLD ~0.47 against float, where "Paris"
        # came and went with rounding): the program answers as its reference does, word for word at first
        assert france["pte_text"][:20] == france["reference_text"][:20], (france["pte_text"], france["reference_text"])
