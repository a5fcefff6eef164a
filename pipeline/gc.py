"""gc: drop stage-cache entries that no build can reach any more, and the leftovers of dead builders.

    python -m pipeline.gc --dry-run        # what would go, and how many bytes
    python -m pipeline.gc                  # remove it
    python -m pipeline.gc --output-dir outputs/elsewhere

A stage's cache key hashes its code (source_rev) and the tool versions, so once either changes no
build asks for the old entries again: they only fill the disk. Removed:
- entries whose source_rev or tools differ from what this checkout and environment would use;
- entries without an ok manifest (a cache entry without one does not exist);
- entries whose input entries are removed (nothing can reach them either);
- temp and trash directories whose builder is gone (their key's lock is free).
Every entry is taken under its key's lock (non-blocking: a busy entry is skipped) and renamed away
before it is deleted, so a concurrent build never sees half an entry.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import sys
import uuid
from pathlib import Path

from pipeline import paths
from pipeline.store import read_manifest


def _size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0


def _try_lock(cache: Path, stage: str, key: str):
    lock_dir = cache / ".locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    f = open(lock_dir / f"{stage}-{key}.lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def plan(cache: Path) -> list[tuple[Path, str]]:
    """(path, reason) of everything gc would remove, in removal order."""
    from pipeline.session import source_rev, tool_versions
    from pipeline.stages import ORDER, STAGES
    tools = tool_versions()
    current = {name: source_rev(STAGES[name]) for name in ORDER}
    doomed: dict[tuple[str, str], str] = {}
    manifests: dict[tuple[str, str], dict] = {}
    leftovers: list[tuple[Path, str]] = []
    for name in ORDER:
        d = cache / name
        if not d.is_dir():
            continue
        for entry in sorted(d.iterdir()):
            if entry.name.startswith((".tmp-", ".trash-")):
                leftovers.append((entry, "leftover of an interrupted build"))
                continue
            m = read_manifest(entry)
            if not m or m.get("status") != "ok" or m.get("key") != entry.name:
                doomed[(name, entry.name)] = "no ok manifest"
            elif m.get("source_rev") != current[name]:
                doomed[(name, entry.name)] = f"built by other code (source {m.get('source_rev')}, now {current[name]})"
            elif m.get("tools") != tools:
                changed = sorted(k for k in set(tools) | set(m.get("tools") or {})
                                 if tools.get(k) != (m.get("tools") or {}).get(k))
                doomed[(name, entry.name)] = f"built with other tool versions ({', '.join(changed)})"
            else:
                manifests[(name, entry.name)] = m
    changed = True
    while changed:  # an entry whose inputs are gone is unreachable too
        changed = False
        for (name, key), m in list(manifests.items()):
            gone = [f"{up}/{i['key'][:12]}" for up, i in (m.get("inputs") or {}).items()
                    if (up, i["key"]) in doomed or not (cache / up / i["key"]).is_dir()]
            if gone:
                doomed[(name, key)] = f"its inputs are removed ({', '.join(gone)})"
                del manifests[(name, key)]
                changed = True
    ordered = [(cache / n / k, why) for n in reversed(ORDER) for (s, k), why in doomed.items() if s == n]
    return ordered + leftovers


def collect(cache: Path, dry_run: bool) -> tuple[int, int, int]:
    """Returns (entries removed, bytes freed, entries skipped because busy)."""
    removed = freed = busy = 0
    for path, why in plan(cache):
        stage = path.parent.name
        key = path.name.split("-")[1] if path.name.startswith((".tmp-", ".trash-")) else path.name
        size = _size(path)
        print(f"{'would remove' if dry_run else 'remove'} {stage}/{path.name}  {size / 2**20:,.1f} MiB  ({why})")
        if dry_run:
            removed, freed = removed + 1, freed + size
            continue
        lock = _try_lock(cache, stage, key)
        if lock is None:
            print(f"  skipped: {stage}/{key} is being built or read")
            busy += 1
            continue
        try:
            if path.exists():
                trash = path.with_name(f".trash-{key}-{uuid.uuid4().hex[:8]}-gc")
                os.rename(path, trash)
                shutil.rmtree(trash, ignore_errors=True)
                removed, freed = removed + 1, freed + size
        finally:
            lock.close()
    return removed, freed, busy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.gc", description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    ap.add_argument("--output-dir", default="outputs", help="the outputs directory whose cache to collect")
    args = ap.parse_args(argv)
    if not paths.is_inside_outputs(args.output_dir):
        print(f"error: --output-dir={args.output_dir!r}: must be inside {paths.OUTPUTS_ROOT}", file=sys.stderr)
        return 2
    cache = paths.project_path(args.output_dir) / "cache"
    if not cache.is_dir():
        print(f"no stage cache at {cache}")
        return 0
    removed, freed, busy = collect(cache, args.dry_run)
    verb = "would free" if args.dry_run else "freed"
    print(f"{removed} entr{'y' if removed == 1 else 'ies'}, {verb} {freed / 2**30:.2f} GiB"
          + (f"; {busy} busy, skipped" if busy else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
