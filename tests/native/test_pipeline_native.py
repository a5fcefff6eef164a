"""pipeline/native.py: build-on-demand and the run()/encode() API."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline import native


def test_runner_path_and_cli(native_bins):
    path = native.runner_path(build=True)
    assert path == native_bins[0] and path.exists() and os.access(path, os.X_OK)
    proc = subprocess.run([sys.executable, "-m", "pipeline.native", "path"], capture_output=True, text=True,
                          cwd=str(native.NATIVE_DIR.parent), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(path)


def test_run_matches_reference(native_bins, tiny_programs):
    import json

    ref = json.loads((tiny_programs / "reference.json").read_text())
    stats = native.run(tiny_programs / "tiny_last.pte", None, prompt_ids=ref["prompt_ids"],
                       max_new_tokens=ref["n_new"])
    gen = stats["generated_ids"]
    assert gen == ref["tiny_last"][:len(gen)]
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
    ids = native.encode(smollm2_model_dir / "tokenizer.json", "What is the capital of France?", "chatml")
    assert ids[:3] == [1, 9690, 198] and ids[-3:] == [520, 9531, 198]
