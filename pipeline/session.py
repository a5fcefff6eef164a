"""One build: preflight, then each stage from the cache or freshly built, then the run manifest.

A stage's cache key (pipeline/store/key.py) = hash(stage name, version, its config slice, upstream keys, tool
versions, the code it runs). Stage entries are published atomically; the run directory links them.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import psutil
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline import paths, preflight
from pipeline.config import v
from pipeline.errors import PipelineError, StageError
from pipeline.exporters import EXPORTERS
from pipeline.report.summary import print_summary
from pipeline.stages import ORDER, STAGES, StageContext, with_prerequisites
from pipeline.store import Store, outputs_digest
from pipeline.store.remote import Remote, RemoteUnreachable, host_name
from pipeline.store.files import SCHEMA_VERSION, describe_outputs, now_iso, read_manifest, stable_hash, write_json_atomic
from pipeline.store.key import config_slice, git_commit, lineage, stage_key, tool_versions

log = logging.getLogger(__name__)

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # the disk cannot take the stage's files


class PeakRSS:
    """Samples this process's RSS in a thread: the peak while a stage runs, in MiB."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._proc = psutil.Process()

    def __enter__(self):
        self.peak = self._proc.memory_info().rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def mib(self) -> float:
        return round(self.peak / 2**20, 1)


def build_hash(cfg: DictConfig) -> str:
    """Hash of everything that shapes the program (all stages up to lower): baked into the .pte."""
    keys = [k for name in ORDER if name != "verify" for k in STAGES[name].CONFIG_KEYS]
    return stable_hash(config_slice(cfg, keys))[:16]


def run_dir(cfg: DictConfig) -> Path:
    try:
        from hydra.core.hydra_config import HydraConfig
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under Hydra (tests call build() directly)
        d = paths.project_path(cfg.run.output_dir) / "runs" / time.strftime("%Y%m%d-%H%M%S")
        d = d.with_name(f"{d.name}-{os.getpid()}-{time.time_ns() % 10**6}")
        d.mkdir(parents=True, exist_ok=True)
        return d


def hydra_overrides() -> list[str]:
    """The command-line overrides of this (sweep) job, for manifests and sweep reports."""
    try:
        from hydra.core.hydra_config import HydraConfig
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


def recipe_name() -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig
        return HydraConfig.get().runtime.choices.get("recipe")
    except ValueError:
        return None


def build(cfg: DictConfig, recipe: str | None = None, stages=ORDER) -> dict:
    try:  # the program's config as composed, before preflight fills in its choices (generate finds builds by it)
        composition = build_hash(cfg)
    except OmegaConfBaseException:  # a value that does not resolve: preflight names it, clearly
        composition = None
    fitted: list[str] = []
    geometry = preflight.check(cfg, notes=fitted)  # every config problem, before any work
    for note in fitted:
        log.info("preflight chose %s", note)
    stages = with_prerequisites(stages)  # a caller naming quantize gets calibrate too
    if cfg.run.until is not None:
        stages = tuple(stages[:stages.index(v(cfg.run.until)) + 1])
    store = Store(paths.project_path(cfg.run.output_dir))
    remote = Remote(cfg.run.store_url, cfg.run.store_lease_s) if cfg.run.store_url else None
    rdir = run_dir(cfg)
    recipe = recipe or recipe_name() or "default"
    tools, bhash, commit = tool_versions(), build_hash(cfg), git_commit()
    manifest = {
        "schema_version": SCHEMA_VERSION, "recipe": recipe, "build_hash": bhash, "composition": composition,
        "started": now_iso(),
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), "tools": tools,
        "git_commit": commit, "argv": sys.argv[1:], "overrides": hydra_overrides(), "pid": os.getpid(), "stages": [],
        "trust_remote_code": bool(cfg.model.trust_remote_code),  # off unless the recipe turns it on
        "preflight_chose": fitted, "status": "running",
        "store_url": remote.public_url if remote else None,  # without credentials: they come from the environment
        "host": host_name(),
    }
    manifest["config"]["run"]["store_url"] = manifest["store_url"]
    entries: dict[str, Path] = {}
    keys: dict[str, str] = {}
    t_start = time.perf_counter()
    try:
        for name in stages:
            if name == "verify" and not cfg.verify.enabled:
                continue
            mod = STAGES[name]
            lin = lineage(mod, cfg, {p: keys[p] for p in ORDER if p in keys}, tools, commit)
            key = keys[name] = stage_key(mod, lin)
            record = {"name": name, "key": key}
            manifest["stages"].append(record)
            t0 = time.perf_counter()
            upstream = {p: entries[p] for p in lin["upstream"]}
            entry = store.lookup(name, key, upstream)
            if entry is None:
                with store.lock(name, key):
                    damaged = store.quarantine_damaged(name, key, upstream)
                    if damaged:
                        record["quarantined"] = damaged
                    entry = store.lookup(name, key, upstream)  # someone else may have built it meanwhile
                    if entry is None:
                        entry = _obtain(store, remote, mod, key, cfg, dict(entries), geometry, bhash, lin, rdir,
                                        record)
            record.setdefault("cache", "hit")
            record.update(seconds=round(time.perf_counter() - t0, 2), status="ok", path=str(entry))
            stage_manifest = read_manifest(entry) or {}
            record["built_seconds"] = stage_manifest.get("seconds")
            record["peak_rss_mib"] = stage_manifest.get("peak_rss_mib")
            record["metrics"] = stage_manifest.get("metrics", {})
            entries[name] = entry
            _link(rdir / name, entry)
            log.info("stage=%s key=%s cache=%s %.1fs", name, key[:12], record["cache"], record["seconds"])
        manifest["status"] = "ok"
    except StageError as e:
        manifest["status"] = "failed"
        manifest["error"] = str(e)
        manifest["stages"][-1].update(status="failed", error=str(e))
        raise
    except KeyboardInterrupt:
        manifest["status"] = "interrupted"
        raise
    except OSError as e:  # the cache or run dir itself (lock, temp dir, link) cannot be written
        if e.errno not in NO_ROOM:
            raise
        manifest.update(status="failed", error=f"{e.strerror}: {e.filename}")
        raise PipelineError(f"cannot write under {store.root}: {e.strerror} ({e.filename}); "
                            "nothing half-built was published") from None
    finally:
        manifest["seconds"] = round(time.perf_counter() - t_start, 2)
        _finish_manifest(manifest, entries, cfg)
        unwritten = None
        try:
            write_json_atomic(rdir / "manifest.json", manifest)
            manifest["run_manifest"] = str(rdir / "manifest.json")
        except OSError as e:
            unwritten = f"cannot write the run manifest {rdir / 'manifest.json'}: {e.strerror}"
            log.error(unwritten)
        if manifest["status"] in ("ok", "failed"):
            print_summary(manifest)
    if unwritten:  # the build itself is fine and cached; only its record is missing
        raise PipelineError(unwritten)
    return manifest


def _finish_manifest(manifest: dict, entries: dict, cfg) -> None:
    if "download" in entries:
        manifest["model_dir"] = str(entries["download"] / "model")
        manifest["tokenizer"] = str(entries["download"] / "model" / "tokenizer.json")
    if "lower" in entries:
        manifest.update(EXPORTERS[cfg.export.exporter].artifacts(entries["lower"]))
        # what `llm_runner --verify-pte` checks the file against (it reads the lower entry's manifest beside it)
        recorded = (read_manifest(entries["lower"]) or {}).get("outputs", {}).get(Path(manifest.get("pte", "")).name)
        if recorded:
            manifest["pte_sha256"] = recorded["sha256"]
        lower = next((s for s in manifest["stages"] if s["name"] == "lower" and s.get("metrics")), None)
        if lower and "deploy" in lower["metrics"]:  # the operators beyond stock ExecuTorch, the runners that run it
            manifest["deploy"] = lower["metrics"]["deploy"]
    verify = next((s for s in manifest["stages"] if s["name"] == "verify" and s.get("status") == "ok"), None)
    if verify:
        manifest["verify"] = verify["metrics"]


def _record_failure(store, tmp: Path, rdir: Path, stage: str, m: dict, err: Exception) -> str | None:
    """failed-<stage>.json (and what the stage wrote, e.g. verify's report) in the run dir, never in the cache.
    Out of space or read-only: the temp dir goes (it holds the space) and the failure is only reported."""
    if isinstance(err, OSError) and err.errno in NO_ROOM:
        store.discard(tmp)
    try:
        failed = rdir / f"failed-{stage}.json"
        write_json_atomic(failed, m)
        if tmp.is_dir() and any(tmp.iterdir()):
            os.rename(tmp, rdir / f"failed-{stage}")
        return str(failed)
    except OSError as e:
        log.error("could not record the failure of stage %s in %s: %s", stage, rdir, e)
        return None
    finally:
        store.discard(tmp)


def _link(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def _obtain(store, remote, mod, key, cfg, inputs, geometry, bhash, lin, rdir, record) -> Path:
    """A local miss, under the key's local lock: the remote store's entry if it has one (waiting while another
    host builds it), else built here and published there."""
    lease = None
    if remote is not None:
        try:
            entry, lease = remote.obtain(store, mod.NAME, key, record)
        except (OSError, *RemoteUnreachable) as e:
            raise PipelineError(f"run.store_url={remote.public_url}: cannot read the store ({e})") from None
        if entry is not None:
            upstream = {p: inputs[p] for p in lin["upstream"]}
            if store.lookup(mod.NAME, key, upstream) is not None:
                record["cache"] = "remote"
                return entry
            # built from other bytes of an input than ours (e.g. an input built here before the store was shared)
            store.quarantine_damaged(mod.NAME, key, upstream)
    try:
        entry = _run_stage(store, mod, key, cfg, inputs, geometry, bhash, lin, rdir)
        record.update(cache="miss", built_by=host_name())
        if lease is not None:
            try:
                record["remote"] = "published" if remote.publish(mod.NAME, key, entry) else "lost the race"
            except (OSError, *RemoteUnreachable) as e:  # built and cached here; the other hosts will build it too
                record["remote"] = f"not published: {e}"
                log.warning("stage %s: built, but not published to %s: %s", mod.NAME, remote.public_url, e)
        return entry
    finally:
        if lease is not None:
            lease.release()


@contextlib.contextmanager
def fewer_collections(young: int = 50_000):
    """Python's cyclic GC runs a young collection every `young` net allocations instead of every 700. Tracing and
    lowering allocate millions of short-lived objects beside a program's live graph; at the default each collection
    walks what survived the last, ~8 % of the default build's lowering. Peak RSS stayed the same; the collect after
    each stage frees the rest."""
    saved = gc.get_threshold()
    gc.set_threshold(young, 20, 20)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def _run_stage(store, mod, key, cfg, inputs, geometry, bhash, lin, rdir) -> Path:
    tmp = store.new_temp(mod.NAME, key)
    ctx = StageContext(cfg=cfg, out=tmp, inputs=inputs, geometry=geometry, build_hash=bhash,
                       progress=cfg.run.progress)
    m = {
        "schema_version": SCHEMA_VERSION, "stage": mod.NAME, "version": mod.VERSION, "key": key,
        "config": lin["config"],
        "inputs": {name: {"key": k, "path": str(inputs[name]), "outputs": outputs_digest(inputs[name])}
                   for name, k in lin["upstream"].items()},
        "tools": lin["tools"], "source_rev": lin["source_rev"], "git_commit": lin["git_commit"],
        "started": now_iso(),
    }
    t0 = time.perf_counter()
    try:
        with PeakRSS() as rss, fewer_collections():
            metrics = mod.run(ctx)
        m.update(status="ok", metrics=metrics, info=ctx.info if mod.NAME != "verify" else {},
                 seconds=round(time.perf_counter() - t0, 2), peak_rss_mib=rss.mib,
                 outputs=describe_outputs(tmp))
        write_json_atomic(tmp / "manifest.json", m)
    except KeyboardInterrupt:
        store.discard(tmp)
        raise
    except Exception as e:
        m.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                 seconds=round(time.perf_counter() - t0, 2))
        detail = str(e) if isinstance(e, (PipelineError, RuntimeError)) else f"{type(e).__name__}: {e}"
        raise StageError(mod.NAME, detail, _record_failure(store, tmp, rdir, mod.NAME, m, e)) from None
    del ctx
    gc.collect()  # stages load whole models; free them before the next one
    return store.publish(tmp, mod.NAME, key)
