"""Shared fixtures: composing configs with Hydra's compose API and building through the shared cache.

Builds go through the real stage cache under outputs/, so a recipe (or the download of a real model)
is built once per machine and reused by every test that needs it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import pipeline.cli  # noqa: F401  (registers the schemas, recipes and the project_path resolver)
from pipeline.paths import CONF_DIR, ROOT


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: builds or loads one of the two real models (slow)")


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def build(recipe: str, *overrides: str, stages=None):
    from pipeline.session import ORDER, build as _build
    cfg = compose_cfg(f"recipe={recipe}", "run.progress=false", *overrides)
    return _build(cfg, recipe=recipe, stages=stages or ORDER)


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def run_manifest(r: subprocess.CompletedProcess) -> dict:
    """The run manifest a `python -m pipeline` build names on its last line of output."""
    lines = r.stdout.strip().splitlines()
    assert lines[-2].startswith("pte: ") and lines[-1].startswith("manifest: "), r.stdout[-3000:]
    return json.loads(Path(lines[-1].split(": ", 1)[1]).read_text())


def build_cli(recipe: str, *overrides: str, timeout: int = 3000) -> dict:
    """A build in a process of its own, as a user runs it; returns its run manifest."""
    r = run_cli(f"recipe={recipe}", "run.progress=false", *overrides, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return run_manifest(r)


@pytest.fixture(scope="session")
def smollm2_model_dir():
    m = build("smollm2_xnnpack", stages=("download",))
    return m["model_dir"]


@pytest.fixture(scope="session")
def gemma3_model_dir():
    m = build("gemma3_xnnpack", stages=("download",))
    return m["model_dir"]
