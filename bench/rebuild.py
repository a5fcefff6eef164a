"""Cold vs warm rebuild time and export/lower peak RSS for one recipe (a benchmark, not a test).

    python bench/rebuild.py                         # tiny_llama_xnnpack
    python bench/rebuild.py --recipe smollm2_xnnpack_8da4w

The cold build uses a fresh stage cache (outputs/bench/rebuild-<time>/), the warm build reruns the
same command on it, so the ratio is measured in one invocation on the same machine.
"""
from __future__ import annotations

import argparse
import shutil
import time

from common import ROOT, build as pipeline_build


def build(recipe: str, out: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    manifest = pipeline_build([f"recipe={recipe}", f"run.output_dir={out}"], verify=True)
    return time.perf_counter() - t0, manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tiny_llama_xnnpack")
    ap.add_argument("--keep", action="store_true", help="keep the benchmark's stage cache")
    args = ap.parse_args()
    out = f"outputs/bench/rebuild-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        cold, m = build(args.recipe, out)
        warm, m2 = build(args.recipe, out)
    finally:
        if not args.keep:
            shutil.rmtree(ROOT / out, ignore_errors=True)
    print(f"recipe {args.recipe}")
    print(f"  {'stage':<9} {'cold s':>8} {'peak RSS MiB':>13}")
    for s in m["stages"]:
        print(f"  {s['name']:<9} {s['seconds']:>8.1f} {s.get('peak_rss_mib') or 0:>13.0f}")
    hits = sum(s["cache"] == "hit" for s in m2["stages"])
    print(f"cold build   {cold:8.1f} s (wall, including interpreter start)")
    print(f"warm rebuild {warm:8.1f} s ({hits}/{len(m2['stages'])} cache hits)")
    print(f"warm/cold    {warm / cold:8.3f}   (speedup x{cold / warm:.1f})")
    export_rss = max(s.get("peak_rss_mib") or 0 for s in m["stages"] if s["name"] in ("export", "lower"))
    print(f"export+lower peak RSS {export_rss:.0f} MiB")


if __name__ == "__main__":
    main()
