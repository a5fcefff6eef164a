"""What no build can reach any more: the entries gc removes, and removing them under their locks.

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

from pathlib import Path

from pipeline.store import Store
from pipeline.store.files import read_manifest
from pipeline.store.key import source_rev, tool_versions


def _size(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else 0


def plan(store: Store, stages: dict) -> list[tuple[Path, str]]:
    """(path, reason) of everything gc would remove, in removal order; `stages`: name -> stage module, in order."""
    tools = tool_versions()
    current = {name: source_rev(mod) for name, mod in stages.items()}
    doomed: dict[tuple[str, str], str] = {}
    manifests: dict[tuple[str, str], dict] = {}
    leftovers: list[tuple[Path, str]] = []
    for name in stages:
        d = store.cache / name
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
                    if (up, i["key"]) in doomed or not store.entry(up, i["key"]).is_dir()]
            if gone:
                doomed[(name, key)] = f"its inputs are removed ({', '.join(gone)})"
                del manifests[(name, key)]
                changed = True
    ordered = [(store.entry(n, k), why) for n in reversed(list(stages)) for (s, k), why in doomed.items() if s == n]
    return ordered + leftovers


def collect(store: Store, stages: dict, dry_run: bool, say=print) -> tuple[int, int, int]:
    """Returns (entries removed, bytes freed, entries skipped because busy)."""
    removed = freed = busy = 0
    for path, why in plan(store, stages):
        stage = path.parent.name
        key = path.name.split("-")[1] if path.name.startswith((".tmp-", ".trash-")) else path.name
        size = _size(path)
        say(f"{'would remove' if dry_run else 'remove'} {stage}/{path.name}  {size / 2**20:,.1f} MiB  ({why})")
        if dry_run:
            removed, freed = removed + 1, freed + size
            continue
        lock = store.try_lock(stage, key)
        if lock is None:
            say(f"  skipped: {stage}/{key} is being built or read")
            busy += 1
            continue
        try:
            if path.exists():
                store.remove(path, key, "-gc")
                removed, freed = removed + 1, freed + size
        finally:
            lock.close()
    return removed, freed, busy


def verify(store: Store, stages: dict, say=print) -> tuple[int, int, int]:
    """Hash every file of every entry against its manifest (no stamps trusted) and check each entry was built from
    its inputs as they are now; damaged entries are quarantined. Returns (entries checked, quarantined, busy)."""
    checked = quarantined = busy = 0
    for name in stages:
        d = store.cache / name
        for entry in sorted(d.iterdir()) if d.is_dir() else ():
            m = None if entry.name.startswith(".") else read_manifest(entry)
            if not m or m.get("status") != "ok" or m.get("key") != entry.name:
                continue  # not an entry (gc's business, not fsck's)
            checked += 1
            inputs = {up: store.entry(up, i["key"]) for up, i in (m.get("inputs") or {}).items()}
            inputs = {up: path for up, path in inputs.items() if path.is_dir()}  # a gone input: judged on use
            found = store.damage(name, entry.name, m, inputs, trust_stamps=False)
            if not found:
                continue
            lock = store.try_lock(name, entry.name)
            if lock is None:
                say(f"damaged but busy, left in place: {name}/{entry.name} ({'; '.join(found)})")
                busy += 1
                continue
            try:
                moved = store.quarantine(name, entry.name, found)
                say(f"quarantined {name}/{entry.name} -> {moved} ({'; '.join(found)})")
                quarantined += 1
            finally:
                lock.close()
    return checked, quarantined, busy
