"""The report at the end of a sweep (`python -m pipeline -m ...`): one row per job, Pareto-optimal rows marked.

A Hydra callback (conf/config.yaml, hydra.callbacks.sweep_report) that reads every job's manifest in the
sweep directory and writes report.md, report.csv, report.json and report.png (pte size vs C++ decode
tok/s, KLD against float as colour) next to them. Also usable on an existing sweep (pipeline/commands/sweep_report.py):

    python -m pipeline sweep_report outputs/sweeps/20261129-120000
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

COLUMNS = ["job", "overrides", "status", "pte_mib", "export_s", "export_peak_rss_mib", "prefill_tok_s",
           "decode_tok_s", "runner_peak_rss_mib", "token_match", "top1", "kld", "corpus_kld", "pareto",
           "host", "built", "fetched", "wait_s", "error"]
# host: where the job ran; built: its stages built there; fetched: taken from the remote store (run.store_url);
# wait_s: time spent waiting on another host's build of the same entry
# objectives of the Pareto front: smaller, faster, closer to float (the corpus KLD when every job measured it:
# verify.fidelity_chunks; the verify prompts' KLD, 2 x 16 tokens, orders a front poorly)
OBJECTIVES = (("pte_mib", min), ("decode_tok_s", max), ("kld", min))


def job_row(job_dir: Path) -> dict:
    row: dict[str, Any] = {c: None for c in COLUMNS}
    row["job"] = job_dir.name
    path = job_dir / "manifest.json"
    launched = job_dir / "launcher.json"  # what a distributed launcher saw (hydra_plugins/pipeline_dask_launcher)
    launcher = json.loads(launched.read_text()) if launched.exists() else {}
    row["host"] = launcher.get("host")
    if not path.exists():
        row.update(status="missing" if not launcher.get("error") else "failed",
                   error=launcher.get("error") or "no manifest (the job did not start or was killed)")
        return row
    m = json.loads(path.read_text())
    row["host"] = m.get("host") or row["host"]
    row["built"] = sum(s.get("cache") == "miss" for s in m.get("stages", []))
    row["fetched"] = sum(s.get("cache") == "remote" for s in m.get("stages", []))
    row["wait_s"] = round(sum(s.get("remote_wait_s") or 0 for s in m.get("stages", [])), 1)
    row["overrides"] = " ".join(m.get("overrides") or [])
    row["status"] = m.get("status")
    if m.get("error"):
        row["error"] = " ".join(ln.strip() for ln in m["error"].splitlines() if ln.strip())[:300]
    stages = {s["name"]: s for s in m.get("stages", [])}
    if m.get("programs"):  # a route of several programs (transformers: prefill.pte + decode.pte, weights in both)
        row["pte_mib"] = round(sum(Path(p).stat().st_size for p in m["programs"].values()) / 2**20, 1)
    elif m.get("pte") and Path(m["pte"]).exists():
        row["pte_mib"] = round(Path(m["pte"]).stat().st_size / 2**20, 1)
    built = [stages[n].get("built_seconds") for n in ("export", "lower") if n in stages]
    if built and all(b is not None for b in built):
        row["export_s"] = round(sum(built), 1)
    rss = [stages[n].get("peak_rss_mib") for n in ("export", "lower") if n in stages]
    if rss and any(r is not None for r in rss):
        row["export_peak_rss_mib"] = max(r for r in rss if r is not None)
    v = m.get("verify") or {}
    native = v.get("native") or {}
    row["prefill_tok_s"] = _round(native.get("prefill_tok_s"))
    row["decode_tok_s"] = _round(native.get("decode_tok_s"))
    row["runner_peak_rss_mib"] = _round(native.get("peak_rss_mib"))
    same, flt = v.get("same_quant") or {}, v.get("vs_float") or {}
    if same:
        row["token_match"] = f"{same.get('greedy_match')}/{same.get('greedy_total')}"
    if flt:
        row["top1"] = _round(flt.get("top1"), 3)
        row["kld"] = _round(flt.get("kld"), 4)
    if v.get("fidelity"):
        row["corpus_kld"] = _round(v["fidelity"]["kld_mean"], 5)
    return row


def _round(x, nd=1):
    return None if x is None else round(float(x), nd)


def mark_pareto(rows: list[dict]) -> None:
    """A row is Pareto-optimal if no other complete row is at least as good on every objective and
    better on one."""
    ok = [r for r in rows if r["status"] == "ok"]
    objectives = OBJECTIVES
    if ok and all(r.get("corpus_kld") is not None for r in ok):
        objectives = tuple(("corpus_kld", pick) if k == "kld" else (k, pick) for k, pick in OBJECTIVES)
    complete = [r for r in ok if all(r[k] is not None for k, _ in objectives)]

    def better_or_equal(a, b, key, pick):
        return a[key] == pick(a[key], b[key])

    for r in rows:
        r["pareto"] = False
    for r in complete:
        dominated = any(
            o is not r and all(better_or_equal(o, r, k, p) for k, p in objectives)
            and any(o[k] != r[k] for k, _ in objectives)
            for o in complete)
        r["pareto"] = not dominated


def collect(sweep_dir: Path) -> list[dict]:
    jobs = sorted((d for d in sweep_dir.iterdir() if d.is_dir() and d.name.startswith("job")),
                  key=lambda d: int(d.name[3:]) if d.name[3:].isdigit() else 0)
    rows = [job_row(d) for d in jobs]
    mark_pareto(rows)
    return rows


def _cell(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "**yes**" if x else ""
    return str(x).replace("|", "\\|")


def write_reports(sweep_dir: Path, rows: list[dict]) -> dict[str, Path]:
    out = {"json": sweep_dir / "report.json", "csv": sweep_dir / "report.csv", "md": sweep_dir / "report.md",
           "png": sweep_dir / "report.png"}
    out["json"].write_text(json.dumps(rows, indent=2))
    with open(out["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    ok = sum(r["status"] == "ok" for r in rows)
    lines = [f"# Sweep report: {sweep_dir.name}", "",
             f"{len(rows)} job(s): {ok} ok, {len(rows) - ok} failed. Pareto-optimal = no other job is at least as "
             "small, as fast (C++ decode) and as close to float (KLD) and better on one.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    lines += ["", "![size vs decode speed](report.png)", ""]
    out["md"].write_text("\n".join(lines))
    plot(rows, out["png"])
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r["pte_mib"] is not None and r["decode_tok_s"] is not None]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    if pts:
        klds = [r["kld"] if r["kld"] is not None else 0.0 for r in pts]
        sc = ax.scatter([r["pte_mib"] for r in pts], [r["decode_tok_s"] for r in pts], c=klds, cmap="viridis_r",
                        s=[140 if r["pareto"] else 60 for r in pts], edgecolors=["red" if r["pareto"] else "black"
                                                                                  for r in pts])
        fig.colorbar(sc, ax=ax, label="KLD vs float eager (lower is better)")
        # label each point by what varies across the sweep, not by what all jobs share
        common = set.intersection(*(set((r["overrides"] or "").split()) for r in rows)) if rows else set()
        for r in pts:
            label = " ".join(o for o in (r["overrides"] or "").split() if o not in common) or r["job"]
            ax.annotate(f"{label}\nKLD {r['kld'] if r['kld'] is not None else '-'}", (r["pte_mib"], r["decode_tok_s"]),
                        textcoords="offset points", xytext=(6, 6), fontsize=7)
    else:
        ax.text(0.5, 0.5, "no job has both a .pte and C++ decode figures", ha="center", transform=ax.transAxes)
    ax.margins(0.2)
    ax.set_xlabel(".pte size (MiB)")
    ax.set_ylabel("C++ runner decode (tok/s)")
    ax.set_title("Sweep: size vs decode speed (red edge = Pareto-optimal)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def report(sweep_dir: Path) -> tuple[list[dict], dict[str, Path]]:
    rows = collect(sweep_dir)
    return rows, write_reports(sweep_dir, rows)


class SweepReport(Callback):
    """Hydra callback: write the report when the multirun ends (also after failed jobs)."""

    failed_jobs = 0

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows, paths = report(sweep_dir)
        SweepReport.failed_jobs = sum(r["status"] != "ok" for r in rows)
        print(f"\nsweep: {len(rows)} job(s), {SweepReport.failed_jobs} failed")
        for r in rows:
            mark = "*" if r["pareto"] else " "
            print(f" {mark} {r['job']:<6} {r['status']:<8} {r['overrides'] or ''}"
                  + (f"  error: {r['error']}" if r["error"] else ""))
        print(f"report: {paths['md']}")
