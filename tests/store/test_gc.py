"""python -m pipeline gc: entries built by other code (or with their inputs gone) are removed, current ones
stay and still serve cache hits; --dry-run removes nothing."""
from __future__ import annotations

import json
import shutil

import subprocess
import sys

from tests.helpers import build
from pipeline.paths import OUTPUTS_ROOT, ROOT

OUT = "outputs/test_gc"


def _entries(stage: str) -> set[str]:
    d = OUTPUTS_ROOT / "test_gc" / "cache" / stage
    return {p.name for p in d.iterdir() if not p.name.startswith(".")} if d.is_dir() else set()


def test_gc_removes_what_no_build_can_reach():
    shutil.rmtree(OUTPUTS_ROOT / "test_gc", ignore_errors=True)
    m = build("tiny_llama_xnnpack", f"run.output_dir={OUT}", "verify.native=false")
    keys = {s["name"]: s["key"] for s in m["stages"]}
    # an entry of an older version of the wrap stage's code: copy the current one under another key
    cache = OUTPUTS_ROOT / "test_gc" / "cache"
    old_wrap = cache / "wrap" / ("0" * 24)
    shutil.copytree(cache / "wrap" / keys["wrap"], old_wrap)
    mf = json.loads((old_wrap / "manifest.json").read_text())
    mf.update(key=old_wrap.name, source_rev="0123456789abcdef")
    (old_wrap / "manifest.json").write_text(json.dumps(mf))
    # and a quantize entry built on top of it: unreachable once the old wrap goes
    old_q = cache / "quantize" / ("1" * 24)
    shutil.copytree(cache / "quantize" / keys["quantize"], old_q)
    mq = json.loads((old_q / "manifest.json").read_text())
    mq["key"] = old_q.name
    mq["inputs"]["wrap"]["key"] = old_wrap.name
    (old_q / "manifest.json").write_text(json.dumps(mq))
    # a temp dir of a builder that died
    (cache / "export" / f".tmp-{keys['export']}-1-deadbeef").mkdir()

    gc = lambda *a: subprocess.run([sys.executable, "-m", "pipeline", "gc", "--output-dir", OUT, *a],  # noqa: E731
                                   cwd=ROOT, capture_output=True, text=True, timeout=300)
    r = gc("--dry-run")
    assert r.returncode == 0, r.stderr
    assert "0" * 24 in r.stdout and "1" * 24 in r.stdout and "leftover" in r.stdout and "3 entries" in r.stdout
    assert old_wrap.is_dir() and old_q.is_dir()

    r = gc()
    assert r.returncode == 0, r.stderr
    assert not old_wrap.exists() and not old_q.exists()
    assert not list((cache / "export").glob(".tmp-*"))
    for stage, key in keys.items():
        assert key in _entries(stage), stage  # current entries stay...
    again = build("tiny_llama_xnnpack", f"run.output_dir={OUT}", "verify.native=false")
    assert all(s["cache"] == "hit" for s in again["stages"])  # ...and still serve the next build
    assert subprocess.run([sys.executable, "-m", "pipeline", "gc", "--output-dir", "/tmp"], cwd=ROOT,
                          capture_output=True, text=True).returncode == 2  # only inside outputs/
    shutil.rmtree(OUTPUTS_ROOT / "test_gc", ignore_errors=True)
