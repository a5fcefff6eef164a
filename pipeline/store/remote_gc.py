"""gc for a remote store (`python -m pipeline gc --store-url URL`): the local store's retention rules
(pipeline/store/gc.py) applied to the remote layout (pipeline/store/remote.py).

Removed: entries built by other code or other tool versions, entries whose inputs are removed, entry.json files that
are not an ok manifest, and uploads no entry.json names (a writer killed mid-upload, or the loser of a race) once
they are older than a grace period, so a live upload is never taken. An entry goes commit first (conditional on its
version), then its blobs: a reader sees the whole entry or none. Leases and .quarantine/ are left alone.
"""
from __future__ import annotations

from collections import defaultdict

from pipeline.store.key import source_rev, tool_versions
from pipeline.store.remote import Remote

ORPHAN_GRACE_S = 3600.0


def plan(remote: Remote, stages: dict, grace_s: float = ORPHAN_GRACE_S) -> list[tuple[str, str, list[str], str]]:
    """(stage, key, the object names to delete, reason), in removal order."""
    tools = tool_versions()
    current = {name: source_rev(mod) for name, mod in stages.items()}
    objects: dict[tuple[str, str], dict] = defaultdict(dict)
    for name, info in remote.backend.list(""):
        parts = name.split("/")
        if len(parts) >= 3 and parts[0] in stages:
            objects[(parts[0], parts[1])]["/".join(parts[2:])] = info
    doomed: dict[tuple[str, str], str] = {}
    commits: dict[tuple[str, str], dict] = {}
    out = []
    for (stage, key), files in sorted(objects.items()):
        c = remote.commit(stage, key) if "entry.json" in files else None
        m = (c or {}).get("manifest") or {}
        uploads = {f.split("/")[1] for f in files if f.startswith("blobs/")}
        live = c.get("upload") if c else None
        for up in sorted(uploads - {live}):
            names = [f"{stage}/{key}/{f}" for f in files if f.startswith(f"blobs/{up}/")]
            if min(files[f].age_s for f in files if f.startswith(f"blobs/{up}/")) > grace_s:
                out.append((stage, key, names, "an upload no entry names (a writer killed, or a lost race)"))
        if c is None:
            continue
        if m.get("status") != "ok" or m.get("key") != key:
            doomed[(stage, key)] = "no ok manifest"
        elif m.get("source_rev") != current[stage]:
            doomed[(stage, key)] = f"built by other code (source {m.get('source_rev')}, now {current[stage]})"
        elif m.get("tools") != tools:
            doomed[(stage, key)] = "built with other tool versions"
        else:
            commits[(stage, key)] = m
    changed = True
    while changed:
        changed = False
        for (stage, key), m in list(commits.items()):
            gone = [f"{up}/{i['key'][:12]}" for up, i in (m.get("inputs") or {}).items()
                    if (up, i["key"]) in doomed or (up, i["key"]) not in commits]
            if gone:
                doomed[(stage, key)] = f"its inputs are removed ({', '.join(gone)})"
                del commits[(stage, key)]
                changed = True
    for stage in reversed(list(stages)):
        for (s, key), why in sorted(doomed.items()):
            if s == stage:
                files = objects[(s, key)]
                names = [f"{s}/{key}/entry.json"] + [f"{s}/{key}/{f}" for f in files if f.startswith("blobs/")]
                out.append((s, key, names, why))
    return out


def collect(remote: Remote, stages: dict, dry_run: bool, say=print) -> tuple[int, int]:
    """Returns (entries and orphan uploads removed, bytes freed)."""
    removed = freed = 0
    sizes = {name: info.bytes for name, info in remote.backend.list("")}
    for stage, key, names, why in plan(remote, stages):
        size = sum(sizes.get(n, 0) for n in names)
        say(f"{'would remove' if dry_run else 'remove'} {stage}/{key}  {size / 2**20:,.1f} MiB  ({why})")
        if dry_run:
            removed, freed = removed + 1, freed + size
            continue
        commit = f"{stage}/{key}/entry.json"
        if commit in names:
            info = remote.backend.info(commit)
            if info is None or not remote.backend.delete(commit, info.etag):
                say(f"  skipped: {stage}/{key} changed meanwhile")
                continue
        for n in names:
            if n != commit:
                remote.backend.delete(n)
        removed, freed = removed + 1, freed + size
    return removed, freed


def quarantined(remote: Remote) -> list[str]:
    return [n for n, _ in remote.backend.list(".quarantine/")]

