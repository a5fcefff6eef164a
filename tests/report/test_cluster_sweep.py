"""Sweeps on a Dask cluster (hydra/launcher=dask) publishing to a shared remote store: a scheduler and two worker
processes on 127.0.0.1 and moto's S3 server, each started by the test and stopped after. Each worker is a "host"
with its own local store (hydra.launcher.output_dir=.../{host}); they share only the S3 bucket."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipeline.paths import ROOT
from tests.store.test_remote_store import _client, _free_port, _keys, bucket, s3  # noqa: F401  (fixtures)

POINTS = ["quantize=none,8w", "export.prefill_chunk=8,16"]
JOBS = 4


def _spawn(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Cluster:
    """`dask scheduler` + workers on loopback. A killed worker's job fails instead of moving to another worker
    (allowed-failures 0), and only the job it was running: the scheduler hands a worker one job at a time
    (worker-saturation 1.0), the rest wait on the scheduler."""

    def __init__(self):
        self.port = _free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.scheduler = _spawn([sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1",
                                 "--port", str(self.port), "--dashboard-address", ":0"],
                                {"DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0",
                                 "DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION": "1.0"})
        self.workers: dict[str, subprocess.Popen] = {}

    def add_worker(self, name: str) -> None:
        self.workers[name] = _spawn([sys.executable, "-m", "dask", "worker", self.address, "--host",
                                     "127.0.0.1", "--nthreads", "1", "--nworkers", "1", "--name", name,
                                     "--no-dashboard", "--no-nanny"], {"PIPELINE_HOST": name})

    def wait_ready(self, n: int) -> None:
        from distributed import Client
        with Client(self.address, timeout=60) as c:
            c.wait_for_workers(n, timeout=60)

    def close(self) -> None:
        for p in [*self.workers.values(), self.scheduler]:
            _stop(p)


@pytest.fixture
def cluster():
    c = Cluster()
    c.add_worker("host-1")
    c.add_worker("host-2")
    try:
        c.wait_ready(2)
        yield c
    finally:
        c.close()


def _sweep(cluster: Cluster, url: str, run: str, background: bool = False):
    args = [sys.executable, "-m", "pipeline", "-m", "recipe=tiny_llama_xnnpack", "run.progress=false",
            "hydra/launcher=dask", f"hydra.launcher.address={cluster.address}",
            f"hydra.launcher.output_dir='outputs/tests/cluster-{run}/{{host}}'", f"run.store_url={url}",
            f"hydra.sweep.dir=outputs/tests/cluster-{run}/sweeps/{uuid.uuid4().hex[:6]}", *POINTS]
    if background:
        return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=1200)


def _report_path(r) -> Path:
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("report: "))
    return Path(line.split(": ", 1)[1])


def _report(r) -> list[dict]:
    return json.loads(_report_path(r).with_suffix(".json").read_text())


def _entries(store: Path) -> set[tuple[str, str]]:
    return {(d.parent.name, d.name) for d in store.glob("*/*")
            if d.is_dir() and not d.name.startswith(".") and not d.parent.name.startswith(".")}


def test_a_sweep_on_two_workers_publishes_each_entry_once_and_reruns_as_hits(cluster, bucket):
    run = uuid.uuid4().hex[:8]
    url = f"s3://{bucket}/sweep"
    r = _sweep(cluster, url, run)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = _report(r)
    assert len(rows) == JOBS and all(row["status"] == "ok" for row in rows)
    assert {row["host"] for row in rows} == {"host-1", "host-2"}  # both workers took jobs
    commits = [k for k in _keys(bucket) if k.endswith("/entry.json")]
    assert sum(row["built"] for row in rows) == len(commits)  # every entry built once, on one host
    # every job shares the download with the others: the host that did not build it fetched it
    assert sum(row["fetched"] for row in rows) >= 1
    assert all(isinstance(row["wait_s"], (int, float)) and row["wait_s"] >= 0 for row in rows)
    # each local store holds exactly the entries its host's jobs used (built there or fetched), and no file of the
    # other's: they share only the bucket
    jobs = [json.loads(p.read_text()) for p in _report_path(r).parent.glob("*/manifest.json")]
    assert len(jobs) == JOBS
    stores = {h: ROOT / "outputs" / "tests" / f"cluster-{run}" / h / "cache" for h in ("host-1", "host-2")}
    for host, store in stores.items():
        used = {(s["name"], s["key"]) for m in jobs if m["host"] == host for s in m["stages"]}
        assert _entries(store) == used, host
        for s in (s for m in jobs if m["host"] == host for s in m["stages"]):
            assert Path(s["path"]).resolve().is_relative_to(store.resolve()), (host, s["path"])
    files = [{f.resolve() for f in store.rglob("*") if f.is_file()} for store in stores.values()]
    assert files[0] and files[1] and not files[0] & files[1]
    rerun = _sweep(cluster, url, run)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    again = _report(rerun)
    assert len(again) == JOBS and all(row["status"] == "ok" and row["built"] == 0 for row in again)


@pytest.mark.slow
def test_a_worker_killed_mid_job_fails_that_job_and_a_rerun_completes_it(cluster, bucket):
    run = uuid.uuid4().hex[:8]
    url = f"s3://{bucket}/sweep"
    proc = _sweep(cluster, url, run, background=True)
    deadline = time.time() + 600
    while time.time() < deadline and not any(k.endswith("lease.json") and "/lower/" in k for k in _keys(bucket)):
        time.sleep(0.2)
    os.killpg(cluster.workers["host-1"].pid, signal.SIGKILL)  # the worker and the job it runs
    out, err = proc.communicate(timeout=1200)
    assert proc.returncode == 1, out[-2000:] + err[-2000:]  # a sweep with a failed job says so
    rows = _report(subprocess.CompletedProcess([], 1, out, err))
    failed = [row for row in rows if row["status"] != "ok"]
    assert len(failed) == 1 and "died mid-job" in failed[0]["error"]  # the job it ran; the others finished
    cluster.add_worker("host-3")
    cluster.wait_ready(2)
    rerun = _sweep(cluster, url, run)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    again = _report(rerun)
    assert len(again) == JOBS and all(row["status"] == "ok" for row in again)
    # only the failed job's own entries (the ones no finished job shares) are built again
    assert sum(row["built"] for row in again) <= 7 and sum(row["built"] for row in again) < sum(
        row["built"] for row in rows if row["built"])


def test_a_sweep_through_submitit_publishes_to_the_remote_store(bucket):
    """SLURM's launcher (hydra-submitit-launcher) with its local executor: the jobs run as submitit processes on
    this machine, as they would on SLURM's nodes, and share the remote store."""
    run = uuid.uuid4().hex[:8]
    r = subprocess.run([sys.executable, "-m", "pipeline", "-m", "recipe=tiny_llama_xnnpack", "run.progress=false",
                        "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=20",
                        f"run.store_url=s3://{bucket}/slurm", f"run.output_dir=outputs/tests/submitit-{run}",
                        "quantize=none,8w"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = _report(r)
    assert [row["status"] for row in rows] == ["ok", "ok"] and all(row["host"] for row in rows)
    assert len([k for k in _keys(bucket) if k.endswith("/entry.json")]) == sum(row["built"] for row in rows)
