"""pipeline/native.py: build-on-demand and the run()/encode() API."""
from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys

import pytest

from pipeline import native


def test_runner_path_and_cli(native_bins):
    path = native.runner_path(build=True)
    assert path == native_bins[0] and path.exists() and os.access(path, os.X_OK)
    proc = subprocess.run([sys.executable, "-m", "pipeline", "native", "path"], capture_output=True, text=True,
                          cwd=str(native.NATIVE_DIR.parent), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(path)


def test_run_matches_reference(native_bins, tiny_programs):
    import json

    ref = json.loads((tiny_programs / "reference.json").read_text())
    stats = native.run(tiny_programs / "tiny_last.pte", None, prompt_ids=ref["prompt_ids"],
                       max_new_tokens=ref["n_new"], extra_args=["--ignore-eos"])  # the whole budget, as the reference
    assert stats["generated_ids"] == ref["tiny_last"] and len(ref["tiny_last"]) == ref["n_new"]
    assert stats["prompt_ids"] == ref["prompt_ids"]


def test_run_error_carries_stderr(native_bins, tmp_path):
    with pytest.raises(native.NativeRunError) as info:
        native.run(tmp_path / "missing.pte", None, prompt_ids=[1, 2])
    assert isinstance(info.value, RuntimeError)
    assert info.value.returncode == 1
    assert "cannot open .pte file" in info.value.stderr
    assert "cannot open .pte file" in str(info.value)
    with pytest.raises(ValueError):
        native.run(tmp_path / "x.pte", None)


@pytest.mark.real_model
def test_encode(native_bins, smollm2_model_dir):
    ids = native.encode(Path(smollm2_model_dir) / "tokenizer.json", "What is the capital of France?", "chatml")
    assert ids[:3] == [1, 9690, 198] and ids[-3:] == [520, 9531, 198]


def test_runner_on_pipeline_tiny_recipe(native_bins):
    """The lead's pipeline output (tiny random Llama): runner == ExecuTorch Python runtime."""
    import json

    from native_tiny_export import python_greedy

    proc = subprocess.run([sys.executable, "-m", "pipeline", "recipe=tiny_llama_xnnpack"], capture_output=True,
                          text=True, cwd=str(native.NATIVE_DIR.parent), timeout=900)
    assert proc.returncode == 0, f"pipeline recipe=tiny_llama_xnnpack failed: {proc.stderr[-3000:]}"
    lines = dict(ln.split(": ", 1) for ln in proc.stdout.strip().splitlines()[-2:])
    manifest = json.loads(open(lines["manifest"]).read())
    prompt = [1, 317, 424, 476, 100, 200, 300, 17, 42, 7] * 2  # 20 ids > the recipe's chunk of 16
    stats = native.run(manifest["pte"], manifest["tokenizer"], prompt_ids=prompt, max_new_tokens=12,
                       extra_args=["--ignore-eos"])
    ref = python_greedy(manifest["pte"], prompt, 12, chunk=stats["max_seq_len"])
    assert stats["generated_ids"] == ref and len(ref) == 12
    assert stats["recipe_hash"]
