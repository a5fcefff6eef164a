"""What the tests share: composing configs with Hydra's compose API, building through the shared stage cache
(in this process or as a user runs it), and the rule that keeps the CI tier's real-model builds few.

Builds go through the real stage cache under outputs/, so a recipe (or the download of a real model) is built
once per machine and reused by every test that needs it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import pipeline.compose  # noqa: F401  (registers the schemas, the recipes and the project_path resolver)
from pipeline.paths import CONF_DIR, ROOT

# The real-model builds the CI tier makes: each once per session, shared through the fixtures of the same name in
# tests/conftest.py. A real-model build anywhere else belongs to the slow tier (`pytest -m slow`); a CI-tier test
# that builds something else fails (see `guard`), so CI's time cannot grow back one build at a time.
CI_BUILDS = {
    "smollm2_model_dir": {"recipe": "smollm2_xnnpack", "stages": ("download",)},
    "gemma3_model_dir": {"recipe": "gemma3_xnnpack", "stages": ("download",)},
    "smollm2_default": {"recipe": None},  # `python -m pipeline` with no recipe: the default build
    "gemma3_offgraph": {"recipe": "gemma3_offgraph", "overrides": ("export.prefill_chunk=128",)},
}

# a build of a model this size or larger is a real-model build (the tiny random models have well under 1M)
REAL_PARAMETERS = 10_000_000
# google/gemma-4-E2B-it's text_config (its published config.json, the fields geometry reads): the hub recipes'
# geometry where the hub cannot be reached
GEMMA4_E2B_TEXT_CONFIG = {
    "model_type": "gemma4_text", "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
    "vocab_size": 262144, "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
    "num_kv_shared_layers": 20, "use_double_wide_mlp": True, "attention_k_eq_v": False, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7, "tie_word_embeddings": True,
}

# set by tests/conftest.py before each test's fixtures: is the running test in the slow tier?
CURRENT = {"test": None, "slow": False}


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def recipe_args(recipe: str | None) -> list[str]:
    """The command-line selection of a recipe; None is the default composition (no recipe)."""
    return [] if recipe is None else [f"recipe={recipe}"]


def _allowed(recipe: str | None, overrides: tuple, stages) -> bool:
    """A CI build, or the first stages of one (cache hits once it is built)."""
    for b in CI_BUILDS.values():
        if b["recipe"] == recipe and tuple(b.get("overrides", ())) == overrides:
            if b.get("stages") is None or (stages is not None and set(stages) <= set(b["stages"])):
                return True
    return False


def guard(recipe: str | None, overrides: tuple, stages: tuple | None = None) -> None:
    """Fails a CI-tier test that built a real model other than a CI_BUILDS entry (called once stages ran)."""
    if CURRENT["slow"]:
        return
    from pipeline.model import sources
    from pipeline.memory_estimate import parameter_count
    try:
        geometry = sources.geometry(compose_cfg(*recipe_args(recipe), *overrides).model)
    except Exception:  # a sweep's comma lists do not compose as one config; a source it cannot read built nothing
        return
    if parameter_count(geometry) < REAL_PARAMETERS:
        return
    if not _allowed(recipe, tuple(o for o in overrides if o != "run.progress=false"), stages):
        pytest.fail(f"{CURRENT['test']}: a real-model build ({recipe or '(default)'} {' '.join(overrides)}) in the CI "
                    f"tier: use one of the shared builds (tests/helpers.py CI_BUILDS: {sorted(CI_BUILDS)}) or mark the "
                    f"test slow")


def build(recipe: str | None, *overrides: str, stages=None) -> dict:
    """A build in this process; returns its run manifest."""
    from pipeline.session import ORDER, build as _build
    cfg = compose_cfg(*recipe_args(recipe), "run.progress=false", *overrides)
    try:
        return _build(cfg, recipe=recipe, stages=stages or ORDER)
    finally:
        guard(recipe, overrides, stages)


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m pipeline ARGS` in a process of its own, as a user runs it."""
    r = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {})})
    recipe = next((a.split("=", 1)[1] for a in args if a.startswith("recipe=")), None)
    if "stage=" in r.stdout + r.stderr:  # stages ran: was it a build the CI tier may make?
        guard(recipe, tuple(a for a in args if not a.startswith(("recipe=", "-"))))
    return r


def unit_binary_results(binary: Path, cases: list[str], timeout: int, env: dict | None = None,
                        command: list[str] | None = None) -> dict:
    """Runs a native unit binary (native/tests: "ok <case>" or "FAIL <case>: <what>" a line, exit 1 if any case
    failed) and gives each case it ran its line. A case name may hold ": " itself, so a FAIL line goes to the known
    case it starts with. `env`: variables added to the environment (LLMPIPE_ISA); `command`: the whole command line,
    when the binary runs under an emulator."""
    proc = subprocess.run(command or [str(binary)], capture_output=True, text=True, errors="replace", timeout=timeout,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    results = {}
    for line in proc.stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status == "ok":
            results[rest] = line
        elif status == "FAIL":
            results[next((c for c in cases if rest.startswith(c + ": ")), rest.split(": ")[0])] = line
    assert proc.returncode == (0 if all(v.startswith("ok") for v in results.values()) else 1), proc.stderr
    return results


def run_manifest(r: subprocess.CompletedProcess) -> dict:
    """The run manifest a `python -m pipeline` build names on its last line of output."""
    lines = r.stdout.strip().splitlines()
    assert lines[-2].startswith("pte: ") and lines[-1].startswith("manifest: "), r.stdout[-3000:]
    return json.loads(Path(lines[-1].split(": ", 1)[1]).read_text())


def build_cli(recipe: str | None, *overrides: str, timeout: int = 3000) -> dict:
    """A build in a process of its own, as a user runs it; returns its run manifest."""
    r = run_cli(*recipe_args(recipe), "run.progress=false", *overrides, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return {**run_manifest(r), "stdout": r.stdout}


def stage_path(manifest: dict, name: str) -> Path:
    return Path(next(s for s in manifest["stages"] if s["name"] == name)["path"])
