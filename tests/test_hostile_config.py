"""Hostile and careless configs: unknown keys however written, paths outside outputs/, recipes that try to move
Hydra's directories. Each is refused with the key named, before any run directory exists; nothing is written
outside outputs/."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pipeline.paths import ROOT
from pipeline.recipes import recipe_files
from tests.helpers import run_cli

TINY = "recipe=tiny_llama_xnnpack"


@pytest.mark.parametrize("override, key", [
    ("+no_such_key=1", "no_such_key=1"),
    ("++no_such_key=1", "no_such_key=1"),
    ("+model.bogus=3", "model.bogus=3"),
    ("++run.extra=x", "run.extra='x'"),
    ("quantize.smoothing=2", "quantize.smoothing=2.0"),
])
def test_refused_before_a_run_directory_exists(override, key):
    out = f"outputs/tests/hostile-{uuid.uuid4().hex[:8]}"  # its own output dir: other test workers make runs too
    r = run_cli(TINY, override, "run.progress=false", f"run.output_dir={out}")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"- {key}:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "stage=" not in r.stdout + r.stderr
    assert not (ROOT / out).exists(), "a rejected config left a run directory behind"


@pytest.mark.parametrize("override, named", [
    ("quantize=nosuch", "quantize=nosuch: no such option (allowed: 4w, "),
    ("export.max_context_len=abc", "export.max_context_len=abc: Value 'abc'"),
    ("export.nosuch=1", "export.nosuch=1: unknown key (allowed here: "),
])
def test_refused_while_hydra_composes_it(override, named):
    """Overrides Hydra itself refuses (no such option, a value of the wrong type, a key without +) exit 2 like any
    rejected config, with one line naming the key, not Hydra's report and its exit 1."""
    out = f"outputs/tests/hostile-{uuid.uuid4().hex[:8]}"
    r = run_cli(TINY, override, "run.progress=false", f"run.output_dir={out}")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith(f"error: {named}"), r.stderr
    assert "Traceback" not in r.stderr and "HYDRA_FULL_ERROR" not in r.stderr, r.stderr
    assert not (ROOT / out).exists()


@pytest.mark.parametrize("args", [
    ("run.output_dir=/tmp/llmpipe-hostile/out",),
    ("hydra.run.dir=/tmp/llmpipe-hostile/run",),
    ("-m", "hydra.sweep.dir=/tmp/llmpipe-hostile/sweep", "quantize=none,8w"),
])
def test_nothing_is_written_outside_outputs(args):
    outside = Path("/tmp/llmpipe-hostile")
    subprocess.run(["rm", "-rf", str(outside)])
    r = run_cli(*args[:1], TINY, *args[1:], "run.progress=false") if args[0] == "-m" else run_cli(TINY, *args)
    assert r.returncode == 2 and "must be inside" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not outside.exists()


def test_a_recipe_folder_from_elsewhere_is_checked_not_obeyed(tmp_path):
    """Extra keys, an output dir outside the project, Hydra settings: every problem reported, nothing written."""
    recipes = {
        "extra_top": "no_such: 1\n",
        "extra_model": "model:\n  bogus: 3\n",
        "outside": f"run:\n  output_dir: {tmp_path / 'evil_out'}\n",
        "hydra_dir": f"hydra:\n  run:\n    dir: {tmp_path / 'evil_run'}\n",
    }
    folder = tmp_path / "recipes"
    folder.mkdir()
    for name, body in recipes.items():
        (folder / f"{name}.yaml").write_text("# @package _global_\ndefaults:\n  - override /model: tiny_llama\n" + body)
    r = subprocess.run([sys.executable, "-m", "pipeline", "validate", str(folder), "--smoke"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout[-3000:]
    assert "4 recipe(s), 4 with problems" in r.stdout
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.split() and ln.split()[0] in recipes}
    assert "Key 'no_such' not in 'PipelineConfig'" in lines["extra_top"]
    assert "Key 'bogus' not in 'ModelConfig'" in lines["extra_model"]
    assert "must be inside" in lines["outside"]
    assert "may not set Hydra's own settings" in lines["hydra_dir"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipes"]


def test_trust_remote_code_is_off_unless_a_recipe_sets_it():
    from tests.helpers import compose_cfg
    for name in recipe_files():
        assert compose_cfg(f"recipe={name}").model.trust_remote_code is False, name
    r = run_cli(TINY, "run.progress=false", "run.until=download")
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("manifest: "), r.stdout[-2000:]
    manifest = json.loads(Path(last.split(": ", 1)[1]).read_text())
    assert manifest["trust_remote_code"] is False
