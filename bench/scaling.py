"""How build time and memory grow with the model: cold builds of random-weight models at real geometries, each
stage's time and peak RSS against the fp32 weights and preflight's estimate (a benchmark, not a test).

    python bench/scaling.py                 # SmolLM2-135M, gemma-3-270m, Llama-3.2-1B, Qwen3.5-0.8B (hybrid) geometry
    python bench/scaling.py --recipes scale_smollm2_135m --keep

Each build runs in its own process on a fresh stage cache (outputs/bench/scaling-<time>/), so every stage is
built and no stage's peak includes another build's. Writes outputs/bench/scaling.json and prints a Markdown table;
`--report` prints that table again against preflight's estimate as the code stands (to recalibrate it).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time

from common import ROOT, build

RECIPES = ("scale_smollm2_135m", "scale_gemma3_270m", "scale_llama32_1b", "scale_qwen35_08b")


def estimate(recipe: str) -> dict:
    """preflight's memory estimate for the recipe (pipeline/preflight.py memory_estimate), in bytes."""
    import psutil

    from pipeline.config import register_configs
    from pipeline.recipes import register_recipes
    from pipeline.commands.validate import validate_recipe
    register_configs()
    register_recipes()
    problems, est, _ = validate_recipe(recipe, psutil.virtual_memory().total)
    if est is None:
        raise SystemExit(f"{recipe}: {problems}")
    return est


def row(recipe: str, out: str) -> dict:
    t0 = time.perf_counter()
    m = build([f"recipe={recipe}", f"run.output_dir={out}"], verify=True)
    wall = time.perf_counter() - t0
    stages = {s["name"]: {"seconds": s["seconds"], "peak_rss_mib": s.get("peak_rss_mib") or 0.0} for s in m["stages"]}
    return {"recipe": recipe, "wall_seconds": wall, "stages": stages,
            "pte_mib": (ROOT / m["pte"]).stat().st_size / 2**20, "verify_passed": m["status"] == "ok"}


def table(rows: list[dict]) -> str:
    """Measured rows against preflight's estimate as the code stands now (so --report re-checks a recalibration)."""
    names = list(rows[0]["stages"])
    lines = ["| model (recipe) | params | fp32 weights | " + " | ".join(names) + " | build | peak / weights |",
             "|" + "---|" * (len(names) + 5),
             "| each stage: seconds, peak RSS (preflight's estimate) | | | " + " | " * len(names) + " |"]
    for r in rows:
        est = estimate(r["recipe"])
        w = est["weights_bytes"] / 2**20
        cells = []
        for name, s in r["stages"].items():
            guess = est["stage_peak_bytes"][name] / 2**20
            cells.append(f"{s['seconds']:.0f} s, {s['peak_rss_mib'] / 1024:.2f} GiB ({guess / 1024:.2f}, "
                         f"{100 * (guess / s['peak_rss_mib'] - 1):+.0f} %)")
        peak = max(s["peak_rss_mib"] for s in r["stages"].values())
        lines.append(f"| {r['recipe']} | {est['params'] / 1e6:.0f} M | {w / 1024:.2f} GiB | " + " | ".join(cells) +
                     f" | {r['wall_seconds']:.0f} s | x{peak / w:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--keep", action="store_true", help="keep the benchmark's stage cache")
    ap.add_argument("--report", action="store_true", help="no builds: the last run's table against today's estimate")
    args = ap.parse_args()
    saved = ROOT / "outputs" / "bench" / "scaling.json"
    if args.report:
        if not saved.exists():
            sys.exit(f"--report: no saved run at {saved.relative_to(ROOT)}; run `python bench/scaling.py` first")
        print(table(json.loads(saved.read_text())))
        return
    out = f"outputs/bench/scaling-{time.strftime('%Y%m%d-%H%M%S')}"
    rows = []
    try:
        for recipe in args.recipes.split(","):
            rows.append(row(recipe, out))
            print(table(rows[-1:]), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(ROOT / out, ignore_errors=True)
        if rows:
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_text(json.dumps(rows, indent=2))
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
