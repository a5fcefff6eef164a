"""The transformers-exporter route builds and verifies a SmolLM2 xnnpack program (export.exporter=transformers:
prefill.pte + decode.pte, KV cache as program I/O), at a small context, through the stage cache. Slow tier: two
fp32 exports of about five minutes each; CI covers the route on a tiny model (tests/exporters)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli, run_manifest

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
RECIPE = "smollm2_xnnpack_hf_exporter"


@pytest.fixture(scope="module")
def cold():
    r = run_cli(f"recipe={RECIPE}", "run.progress=false", timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def test_smollm2_pair_builds_verifies_exactly_and_answers_paris(cold):
    m = run_manifest(cold)
    assert m["status"] == "ok" and m["recipe"] == RECIPE
    assert m["config"]["export"]["exporter"] == "transformers"
    for name, path in m["programs"].items():
        assert Path(path).stat().st_size > 100 * 2**20, name  # fp32 weights in each program
    same = m["verify"]["same_quant"]
    assert same["greedy_match"] == same["greedy_total"] and same["max_logit_err"] < 1e-3
    report = json.loads((Path(m["stages"][-1]["path"]) / "report.json").read_text())
    assert report["passed"]
    france = report["prompts"][0]
    assert "capital of France" in france["prompt"] and "Paris" in france["pte_text"]
    assert "programs:" in cold.stdout and "KLD" in cold.stdout


def test_rerun_is_all_cache_hits(cold):
    r = run_cli(f"recipe={RECIPE}", "run.progress=false")
    assert r.returncode == 0, r.stderr[-3000:]
    m = run_manifest(r)
    assert [s["cache"] for s in m["stages"]] == ["hit"] * 6
    assert m["pte"] == run_manifest(cold)["pte"]
