"""gc: drop stage-cache entries that no build can reach any more, and the leftovers of dead builders.

    python -m pipeline gc --dry-run        # what would go, and how many bytes
    python -m pipeline gc                  # remove it
    python -m pipeline gc --output-dir outputs/elsewhere
    python -m pipeline gc --verify         # fsck: hash every entry against its manifest, quarantine the damaged
    python -m pipeline gc --store-url s3://bucket/prefix [--dry-run]   # the same rules on a remote store

Quarantined entries (cache/.quarantine/, each with a .why.json) are never removed by gc: look, then delete by hand.

What counts as unreachable: pipeline/store/gc.py.
"""
from __future__ import annotations

import argparse
import sys

from pipeline import paths
from pipeline.stages import STAGES
from pipeline.store import Store
from pipeline.store.gc import collect, verify


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline gc", description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    ap.add_argument("--output-dir", default="outputs", help="the outputs directory whose cache to collect")
    ap.add_argument("--verify", action="store_true",
                    help="only check: hash every entry against its manifest and quarantine the damaged ones")
    ap.add_argument("--store-url", help="collect this remote store (run.store_url) instead of the local cache")
    args = ap.parse_args(argv)
    if args.store_url:
        return remote_main(args)
    if not paths.is_inside_outputs(args.output_dir):
        print(f"error: --output-dir={args.output_dir!r}: must be inside {paths.OUTPUTS_ROOT}", file=sys.stderr)
        return 2
    store = Store(paths.project_path(args.output_dir))
    if not store.cache.is_dir():
        print(f"no stage cache at {store.cache}")
        return 0
    if args.verify:
        checked, bad, busy = verify(store, STAGES)
        print(f"{checked} entr{'y' if checked == 1 else 'ies'} checked, {bad} damaged (quarantined in "
              f"{store.quarantine_dir})" + (f", {busy} busy" if busy else ""))
        return 1 if bad or busy else 0
    removed, freed, busy = collect(store, STAGES, args.dry_run)
    held = sorted(p for p in store.quarantine_dir.glob("*") if p.is_dir()) if store.quarantine_dir.is_dir() else []
    if held:
        print(f"{len(held)} quarantined entr{'y' if len(held) == 1 else 'ies'} kept in {store.quarantine_dir} "
              "(see each .why.json; delete by hand)")
    verb = "would free" if args.dry_run else "freed"
    print(f"{removed} entr{'y' if removed == 1 else 'ies'}, {verb} {freed / 2**30:.2f} GiB"
          + (f"; {busy} busy, skipped" if busy else ""))
    return 0


def remote_main(args) -> int:
    from pipeline.store.backends import redacted, url_problem
    from pipeline.store.remote import Remote
    from pipeline.store.remote_gc import collect as collect_remote, quarantined
    why = url_problem(args.store_url)
    if why or args.verify:
        print(f"error: --store-url={redacted(args.store_url)!r}: {why or 'not with --verify (a fetch checks hashes)'}",
              file=sys.stderr)
        return 2
    remote = Remote(args.store_url)
    removed, freed = collect_remote(remote, STAGES, args.dry_run)
    held = quarantined(remote)
    if held:
        print(f"{len(held)} quarantined entr{'y' if len(held) == 1 else 'ies'} kept under "
              f"{remote.public_url}/.quarantine/ (delete by hand)")
    print(f"{removed} entr{'y' if removed == 1 else 'ies'} or uploads, {'would free' if args.dry_run else 'freed'} "
          f"{freed / 2**30:.2f} GiB in {remote.public_url}")
    return 0
