"""The verify gate fails a wrong program, with a decoded diff of the two token streams."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.stages import StageContext, verify
from tests.helpers import build, compose_cfg


def test_a_wrong_program_fails_the_gate(tmp_path):
    right = build("tiny_llama_xnnpack")
    # the same architecture with other weights: a program that runs fine but is not this model
    wrong = build("tiny_llama_xnnpack", "model.random.seed=1", "verify.enabled=false")
    entries = {s["name"]: Path(s["path"]) for s in right["stages"]}
    entries["lower"] = Path(next(s["path"] for s in wrong["stages"] if s["name"] == "lower"))
    cfg = compose_cfg("recipe=tiny_llama_xnnpack")
    ctx = StageContext(cfg=cfg, out=tmp_path, inputs=entries, progress=False)
    with pytest.raises(verify.VerifyFailed) as e:
        verify.run(ctx)
    msg = str(e.value)
    assert "greedy match" in msg and "eager:" in msg and ".pte:" in msg
    report = (tmp_path / "report.json").read_text()
    assert '"passed": false' in report


def test_the_right_program_passes_exactly():
    m = build("tiny_llama_xnnpack")
    same = m["verify"]["same_quant"]
    assert same["greedy_match"] == same["greedy_total"] and same["max_logit_err"] < 1e-4
