"""End to end on a real model: the default build (`python -m pipeline`, no recipe: SmolLM2-135M-Instruct on
XNNPACK), built as a user builds it, verified by the gate calibrated for its scheme, cached."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline import native
from pipeline.runtimes import open_program
from pipeline.stages.verify import gate_of
from tests.helpers import compose_cfg, run_cli, run_manifest, stage_path

pytestmark = pytest.mark.real_model


def test_default_build_verifies_and_answers_paris(smollm2_default):
    m = smollm2_default
    assert m["status"] == "ok" and m["recipe"] == "default"  # the manifest names the no-recipe build "default"
    for key in ("pte", "tokenizer", "model_dir", "stages", "verify"):
        assert m[key]
    assert "KLD" in m["stdout"] and "greedy" in m["stdout"]
    report = json.loads((stage_path(m, "verify") / "report.json").read_text())
    assert report["passed"]
    assert report["summary"]["gate"] == gate_of(compose_cfg())
    france = report["prompts"][0]
    assert "capital of France" in france["prompt"] and "Paris" in france["pte_text"]


def test_pte_names_its_recipe_hash(smollm2_default):
    m = smollm2_default
    pte = open_program(stage_path(m, "lower"))
    assert pte.constant("get_recipe_hash") == m["build_hash"]
    assert pte.constant("get_max_seq_len") == m["config"]["export"]["prefill_chunk"]
    assert pte.constant("get_vocab_size") == 49152


def test_rerun_is_all_cache_hits(smollm2_default):
    r = run_cli("run.progress=false")
    assert r.returncode == 0
    m = run_manifest(r)
    assert [s["cache"] for s in m["stages"]] == ["hit"] * 7
    assert m["pte"] == smollm2_default["pte"]


def test_the_python_runner_answers_paris_with_the_cpp_runners_tokens(smollm2_default):
    """`python -m pipeline generate` on the default program: the chat template the model ships, greedy, streamed."""
    m = smollm2_default
    r = subprocess.run([sys.executable, "-m", "pipeline", "generate", "--pte", m["pte"], "--model-dir", m["model_dir"],
                        "--prompt", "What is the capital of France?", "--max-new-tokens", "24"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Paris" in r.stdout
    stats = json.loads(next(ln for ln in r.stderr.splitlines() if ln.startswith("STATS_JSON: ")).split(": ", 1)[1])
    theirs = native.run(m["pte"], m["tokenizer"], prompt_ids=stats["prompt_ids"], max_new_tokens=24)
    assert stats["generated_ids"] == theirs["generated_ids"] and len(set(stats["generated_ids"])) > 3


def _collapse_supported() -> bool:
    """MADV_COLLAPSE: Linux >= 6.1, transparent huge pages not switched off."""
    import os
    import re
    from pathlib import Path
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return (major, minor) >= (6, 1) and "[never]" not in thp


def test_huge_pages_hold_the_weights_and_change_no_token(smollm2_default):
    """--huge-pages (the default) puts XNNPACK's packed weights on 2 MiB pages; the tokens are those of off."""
    m = smollm2_default
    ids = list(range(100, 132))
    on = native.run(m["pte"], m["tokenizer"], prompt_ids=ids, max_new_tokens=16, extra_args=["--ignore-eos"])
    off = native.run(m["pte"], m["tokenizer"], prompt_ids=ids, max_new_tokens=16,
                     extra_args=["--ignore-eos", "--huge-pages", "off"])
    assert on["generated_ids"] == off["generated_ids"]
    assert off["huge_pages_mib"] == 0
    if _collapse_supported():  # the default build's packed weights are ~100 MiB
        assert on["huge_pages_mib"] > 50, on["huge_pages_mib"]


def test_the_default_program_stores_the_tied_embedding_once(smollm2_default):
    """SmolLM2 ties its lm_head to the 49,152 x 576 embedding: the file holds those int8 values once, and the summary
    prints the file's bits/weight."""
    import torch
    m = smollm2_default
    module = torch.load(stage_path(m, "quantize") / "module.pt", weights_only=False)
    table = module.model.get_input_embeddings().weight.qdata.numpy().tobytes()
    del module
    pte = (stage_path(m, "lower") / "model.pte").read_bytes()
    assert pte.count(table) == 1
    line = next(ln for ln in m["stdout"].splitlines() if "bits/weight" in ln)
    assert "stored once" in line and float(line.split(": ")[1].split()[0]) < 6.2, line


def test_speculation_keeps_the_default_programs_greedy_tokens(smollm2_default):
    """--speculate ngram on the default program (export.logits_mode=auto: `tail`) in both runners: a prompt whose
    answer copies it, so drafts are kept and rejected at many depths; the tokens equal plain decoding's."""
    m = smollm2_default
    text = ("Copy this sentence, but write 'green' instead of 'blue': The small blue boat sailed past the old "
            "harbour wall, and the blue flags on its mast moved slowly in the evening wind.")
    r = subprocess.run([str(native.runner_path()), "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt", text,
                        "--max-new-tokens", "64", "--speculate", "ngram", "--compare-plain", "--quiet"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    cpp = json.loads(next(ln for ln in r.stderr.splitlines() if ln.startswith("STATS_JSON: ")).split(": ", 1)[1])
    spec = cpp["speculation"]
    assert spec["identical"] is True and 0 < spec["accepted"] < spec["drafted"], spec
    py = subprocess.run([sys.executable, "-m", "pipeline", "generate", "--pte", m["pte"], "--model-dir", m["model_dir"],
                         "--prompt", text, "--max-new-tokens", "64", "--speculate", "ngram", "--compare-plain"],
                        capture_output=True, text=True, timeout=600)
    assert py.returncode == 0, py.stderr[-3000:]
    ours = json.loads(next(ln for ln in py.stderr.splitlines() if ln.startswith("STATS_JSON: ")).split(": ", 1)[1])
    assert ours["prompt_ids"] == cpp["prompt_ids"] and ours["generated_ids"] == cpp["generated_ids"]
    assert ours["speculation"]["identical"] is True and ours["speculation"]["accepted"] > 0
