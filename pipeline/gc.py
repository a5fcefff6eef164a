"""gc: drop stage-cache entries that no build can reach any more, and the leftovers of dead builders.

    python -m pipeline.gc --dry-run        # what would go, and how many bytes
    python -m pipeline.gc                  # remove it
    python -m pipeline.gc --output-dir outputs/elsewhere

What counts as unreachable: pipeline/store/gc.py.
"""
from __future__ import annotations

import argparse
import sys

from pipeline import paths
from pipeline.stages import STAGES
from pipeline.store import Store
from pipeline.store.gc import collect


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.gc", description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    ap.add_argument("--output-dir", default="outputs", help="the outputs directory whose cache to collect")
    args = ap.parse_args(argv)
    if not paths.is_inside_outputs(args.output_dir):
        print(f"error: --output-dir={args.output_dir!r}: must be inside {paths.OUTPUTS_ROOT}", file=sys.stderr)
        return 2
    store = Store(paths.project_path(args.output_dir))
    if not store.cache.is_dir():
        print(f"no stage cache at {store.cache}")
        return 0
    removed, freed, busy = collect(store, STAGES, args.dry_run)
    verb = "would free" if args.dry_run else "freed"
    print(f"{removed} entr{'y' if removed == 1 else 'ies'}, {verb} {freed / 2**30:.2f} GiB"
          + (f"; {busy} busy, skipped" if busy else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
