"""The verify gate fails a deliberately broken program (export.fault, pipeline/model/layers/faults.py) while the same
build without the fault passes: tiny random models, each scheme's gate (bench/gate_calibration.py does the same on
the real models and calibrates the thresholds)."""
from __future__ import annotations

import json

import pytest

from pipeline.errors import StageError
from tests.helpers import build, stage_path

CASES = {
    "fp32 (exact gate)": ("tiny_llama_xnnpack",),
    "8da4w (dynamic gate)": ("tiny_llama_xnnpack_8da4w",),
}


FAULTS = ["layer_permuted", "group_scale_doubled", "heads_swapped"]


# the exact gate's other two faults in the slow tier (CI keeps one: that gate fails any change above 1e-5 KLD)
@pytest.mark.parametrize("case,fault", [
    pytest.param(case, fault, marks=[pytest.mark.slow] if case.startswith("fp32") and fault != FAULTS[0] else [])
    for fault in FAULTS for case in CASES])
def test_a_broken_program_fails_the_gate(case, fault):
    assert build(*CASES[case])["status"] == "ok"  # the same build without the fault passes
    with pytest.raises(StageError, match="stage verify failed: verify gate failed"):
        build(*CASES[case], f"export.fault={fault}")


def test_a_ring_one_slot_short_fails_the_gate():
    """Rings of window + chunk - 2 slots: verify's long prompt (window + chunk + 16 tokens) wraps them (tiny gemma3:
    window 16, chunk 8, context 64)."""
    good = build("tiny_gemma3_custom")
    assert good["status"] == "ok"
    report = json.loads((stage_path(good, "verify") / "report.json").read_text())
    assert len(report["prompts"][-1]["prompt_ids"]) == 16 + 8 + 16
    with pytest.raises(StageError, match="stage (verify|lower) failed"):
        build("tiny_gemma3_custom", "export.fault=ring_one_short")
