"""hydra/launcher=dask: each job of a sweep runs on a worker of a Dask cluster, as `python -m pipeline` in a process
of its own there, and publishes to the shared remote store (run.store_url).

    python -m pipeline -m hydra/launcher=dask hydra.launcher.address=tcp://HEAD:8786 \\
        run.store_url=s3://bucket/stages quantize=none,8w,4w

Why a process per job rather than the job in the worker itself: a build holds whole models, torch's thread pools
and the native runner; a process gives each job a clean one and lets the worker outlive a job that crashes. The
worker sends the job's run manifest back, so the sweep report on the driver needs no filesystem shared with the
workers. A worker killed mid-job fails that job (the report gives the reason, the other jobs finish); run the sweep
again to complete it: every entry already published is a hit.
- address: the scheduler (`dask scheduler` on the head); null starts a local cluster of `workers` processes.
- output_dir: each worker's own local store (its jobs' run.output_dir); `{host}` is the worker's host name
  (PIPELINE_HOST, or the machine's name). Null: the jobs' own run.output_dir.
"""

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from omegaconf import open_dict

log = logging.getLogger(__name__)


@dataclass
class DaskLauncherConf:
    _target_: str = "hydra_plugins.pipeline_dask_launcher.dask_launcher.DaskLauncher"
    address: Optional[str] = None   # tcp://HEAD:8786; null: a local cluster
    workers: int = 2                # the local cluster's worker processes
    output_dir: Optional[str] = None  # a worker's local store, `{host}` its host name (e.g. outputs/hosts/{host})


ConfigStore.instance().store(group="hydra/launcher", name="dask", node=DaskLauncherConf, provider="pte-pipeline")


def run_one(overrides: list[str], job_dir: str, output_dir: Optional[str], root: str) -> dict:
    """On a worker: one job as `python -m pipeline`, its run dir `job_dir`. Returns what the driver records."""
    from pipeline.store.remote import host_name
    host = host_name()
    args = [sys.executable, "-m", "pipeline", *overrides, f"hydra.run.dir={job_dir}"]
    if output_dir:
        args.append(f"run.output_dir={output_dir.format(host=host)}")
    r = subprocess.run(args, cwd=root, capture_output=True, text=True, env={**os.environ, "PIPELINE_HOST": host})
    manifest = Path(job_dir) / "manifest.json"
    errors = [ln[len("error: "):] for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    return {"host": host, "returncode": r.returncode, "error": errors[-1] if errors else None,
            "manifest": manifest.read_text() if manifest.exists() else None}


class DaskLauncher(Launcher):
    def __init__(self, address: Optional[str] = None, workers: int = 2, output_dir: Optional[str] = None):
        self.address, self.workers, self.output_dir = address, workers, output_dir
        self.config = self.hydra_context = self.task_function = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def _job_dir(self, overrides: Sequence[str], idx: int) -> Path:
        """The job's directory as Hydra would name it (hydra.sweep.dir / hydra.sweep.subdir)."""
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.num = idx
        return Path(str(self.config.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from distributed import Client, LocalCluster

        from pipeline.paths import ROOT
        logging.getLogger("distributed").setLevel(logging.WARNING)  # its INFO lines would drown the sweep's
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        cluster = None if self.address else LocalCluster(n_workers=self.workers, threads_per_worker=1,
                                                         host="127.0.0.1", dashboard_address=None)
        client = Client(self.address or cluster)
        log.info("Dask launcher: %d jobs on %s", len(job_overrides), self.address or f"a local cluster ({self.workers})")
        try:
            jobs = []
            for i, overrides in enumerate(job_overrides):
                idx = initial_job_idx + i
                job_dir = self._job_dir(overrides, idx)
                job_dir.mkdir(parents=True, exist_ok=True)
                log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
                jobs.append((idx, list(overrides), job_dir))
            return self._run_all(client, jobs, str(ROOT))
        finally:
            client.close()
            if cluster is not None:
                cluster.close()

    def _run_all(self, client, jobs: list, root: str) -> list[JobReturn]:
        """One job per worker thread at a time, the next submitted as one ends: a worker holds only the job it runs,
        so a worker killed mid-job takes that job alone with it (Dask would otherwise queue several on one)."""
        from distributed import as_completed
        pending, results, index = list(jobs), {}, {}

        def submit():
            idx, overrides, job_dir = pending.pop(0)
            fut = client.submit(run_one, overrides, str(job_dir), self.output_dir, root, pure=False,
                                key=f"pipeline-job-{idx}-{os.urandom(4).hex()}")
            index[fut.key] = (idx, overrides, job_dir)
            return fut

        running = as_completed([submit() for _ in range(min(len(pending), max(1, sum(client.nthreads().values()))))])
        for fut in running:
            results[index[fut.key][0]] = self._collect(*index[fut.key], fut)
            if pending:
                running.add(submit())
        return [results[idx] for idx, _, _ in jobs]

    def _collect(self, idx: int, overrides: list[str], job_dir: Path, fut) -> JobReturn:
        try:
            res = fut.result()
            status = "ok" if res["returncode"] == 0 else "failed"
        except Exception as e:  # the worker died mid-job (KilledWorker), or lost its connection
            res = {"host": None, "returncode": None, "manifest": None,
                   "error": f"the worker running it died mid-job ({type(e).__name__}: {e})"}
            status = "failed"
        manifest = job_dir / "manifest.json"
        if res["manifest"] and not manifest.exists():  # a worker with no filesystem shared with the driver
            manifest.write_text(res["manifest"])
        (job_dir / "launcher.json").write_text(json.dumps(
            {"job": idx, "host": res["host"], "returncode": res["returncode"], "status": status,
             "error": res["error"]}, indent=2) + "\n")
        return JobReturn(overrides=overrides, working_dir=str(job_dir), task_name="pipeline",
                         status=JobStatus.COMPLETED, _return_value=status)
