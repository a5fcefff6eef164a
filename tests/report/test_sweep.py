"""Sweeps: Hydra multirun over real builds (tiny models), the report, failed jobs, and two sweeps started
at the same time on one stage cache (real concurrent processes)."""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import pytest

from pipeline.report import sweep as sweep_report
from tests.helpers import ROOT


def sweep(*args: str, out: str | None = None, wait: bool = True):
    cmd = [sys.executable, "-m", "pipeline", "-m", *args, "run.progress=false"]
    if out:
        cmd.append(f"run.output_dir={out}")
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)


def sweep_dir(stdout: str) -> Path:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("report: ")]
    return Path(line.split(": ", 1)[1]).parent


def test_sweep_with_a_failing_job_ends_in_a_report():
    r = sweep("recipe=tiny_llama_xnnpack", "quantize=none,8w", "export.prefill_chunk=8,999")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]  # two jobs failed; the sweep went on
    d = sweep_dir(r.stdout)
    for ext in ("md", "csv", "json", "png"):
        assert (d / f"report.{ext}").stat().st_size > 0
    rows = json.loads((d / "report.json").read_text())
    assert [r_["status"] for r_ in rows] == ["ok", "failed", "ok", "failed"]
    assert all("export.prefill_chunk=999" in r_["error"] for r_ in rows if r_["status"] == "failed")
    ok = [r_ for r_ in rows if r_["status"] == "ok"]
    assert all(r_["pte_mib"] and r_["decode_tok_s"] and r_["token_match"] for r_ in ok)
    assert any(r_["pareto"] for r_ in ok)
    with open(d / "report.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert "| job2 |" in (d / "report.md").read_text()
    # download and wrap ran once for the model: every later job hit the cache
    later = json.loads((d / "job2" / "manifest.json").read_text())
    assert {s["name"]: s["cache"] for s in later["stages"]}["download"] == "hit"
    assert {s["name"]: s["cache"] for s in later["stages"]}["wrap"] == "hit"


def test_two_sweeps_and_a_gc_at_once_share_one_cache_without_duplicates():
    out = f"outputs/tests/concurrent-{uuid.uuid4().hex[:8]}"
    args = ("recipe=tiny_llama_xnnpack", "quantize=none,8da4w", "verify.enabled=false")
    procs = [sweep(*args, out=out, wait=False) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:  # drain their pipes meanwhile
        outputs = [pool.submit(p.communicate, timeout=1800) for p in procs]
        gcs = 0
        while not all(f.done() for f in outputs):  # gc over and over beside them: it must take nothing they need
            gc = subprocess.run([sys.executable, "-m", "pipeline", "gc", "--output-dir", out], cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
            assert gc.returncode == 0, gc.stderr[-2000:]
            gcs += 1
        results = [f.result() for f in outputs]
    assert gcs >= 2
    for p, (so, se) in zip(procs, results):
        assert p.returncode == 0, so[-3000:] + se[-3000:]
    store = ROOT / out / "cache"
    entries = {stage: sorted(p.name for p in (store / stage).iterdir() if not p.name.startswith("."))
               for stage in ("download", "wrap", "calibrate", "quantize", "export", "lower")}
    # neither scheme calibrates from data: one (empty) calibrate entry serves both
    assert {s: len(e) for s, e in entries.items()} == {"download": 1, "wrap": 1, "calibrate": 1, "quantize": 2,
                                                       "export": 2, "lower": 2}
    assert not [p for p in store.rglob(".tmp-*")], "a temp dir was left behind"
    for stage, keys in entries.items():
        for k in keys:
            assert json.loads((store / stage / k / "manifest.json").read_text())["status"] == "ok"
    # each entry was built by exactly one job; every other job found it in the cache
    manifests = [json.loads(p.read_text()) for d in (sweep_dir(so) for so, _ in results)
                 for p in sorted(d.glob("job*/manifest.json"))]
    assert len(manifests) == 4
    built = Counter((s["name"], s["key"]) for m in manifests for s in m["stages"] if s["cache"] == "miss")
    assert set(built.values()) == {1}
    assert len(built) == 1 + 1 + 1 + 2 + 2 + 2
    shutil.rmtree(ROOT / out)


@pytest.mark.slow  # CI runs sweeps on the basic launcher
@pytest.mark.skipif(os.cpu_count() < 2, reason="parallel jobs need two cores")
def test_joblib_launcher_runs_jobs_in_parallel_workers():
    out = f"outputs/tests/joblib-{uuid.uuid4().hex[:8]}"  # a fresh store: both jobs build (no cache hits)
    try:
        r = sweep("hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "recipe=tiny_llama_xnnpack", "quantize=none,8w",
                  out=out)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        d = sweep_dir(r.stdout)
        rows = json.loads((d / "report.json").read_text())
        assert [r_["status"] for r_ in rows] == ["ok", "ok"]
        jobs = [json.loads((d / f"job{i}" / "manifest.json").read_text()) for i in range(2)]
    finally:
        shutil.rmtree(ROOT / out, ignore_errors=True)
    # two worker processes (the basic launcher runs every job in the sweep's own), at the same time: the second
    # started before the first had finished (one after the other, it would start a whole build later)
    assert len({m["pid"] for m in jobs}) == 2
    starts = [datetime.strptime(m["started"], "%Y-%m-%dT%H:%M:%S%z").timestamp() for m in jobs]
    assert abs(starts[0] - starts[1]) < min(m["seconds"] for m in jobs), (starts, [m["seconds"] for m in jobs])


def test_pareto_marking():
    rows = [{"status": "ok", "pte_mib": 10, "decode_tok_s": 100, "kld": 0.5},
            {"status": "ok", "pte_mib": 20, "decode_tok_s": 100, "kld": 0.5},   # dominated by the first
            {"status": "ok", "pte_mib": 30, "decode_tok_s": 50, "kld": 0.0},    # closest to float
            {"status": "failed", "pte_mib": None, "decode_tok_s": None, "kld": None}]
    sweep_report.mark_pareto(rows)
    assert [r["pareto"] for r in rows] == [True, False, True, False]


def test_the_front_ranks_by_the_corpus_kld_when_every_job_measured_it():
    rows = [{"status": "ok", "pte_mib": 10, "decode_tok_s": 100, "kld": 0.1, "corpus_kld": 0.5},
            {"status": "ok", "pte_mib": 10, "decode_tok_s": 100, "kld": 0.5, "corpus_kld": 0.1}]
    sweep_report.mark_pareto(rows)
    assert [r["pareto"] for r in rows] == [False, True]  # the 2 x 16-token prompt KLD would say the opposite
