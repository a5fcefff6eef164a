"""End to end on a real model: SmolLM2-135M-Instruct 8da4w on XNNPACK, built, verified and cached."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.runtime import PteModule
from tests.conftest import run_cli, run_manifest

pytestmark = pytest.mark.real_model
RECIPE = "smollm2_xnnpack_8da4w"


@pytest.fixture(scope="module")
def cold():
    r = run_cli(f"recipe={RECIPE}", "run.progress=false", timeout=3000)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r, None


def test_build_verifies_and_answers_paris(cold):
    r, _ = cold
    m = run_manifest(r)
    assert m["status"] == "ok" and m["recipe"] == RECIPE
    for key in ("pte", "tokenizer", "model_dir", "stages", "verify"):
        assert m[key]
    assert "KLD" in r.stdout and "greedy" in r.stdout
    report = json.loads((Path(m["stages"][-1]["path"]) / "report.json").read_text())
    assert report["passed"]
    france = report["prompts"][0]
    assert "capital of France" in france["prompt"] and "Paris" in france["pte_text"]


def test_pte_names_its_recipe_hash(cold):
    m = run_manifest(cold[0])
    pte = PteModule(Path(m["pte"]))
    assert pte.constant("get_recipe_hash") == m["build_hash"]
    assert pte.constant("get_max_seq_len") == m["config"]["export"]["prefill_chunk"]
    assert pte.constant("get_vocab_size") == 49152


def test_rerun_is_all_cache_hits(cold):
    r = run_cli(f"recipe={RECIPE}", "run.progress=false")
    assert r.returncode == 0
    m = run_manifest(r)
    assert [s["cache"] for s in m["stages"]] == ["hit"] * 6
    assert m["pte"] == run_manifest(cold[0])["pte"]
