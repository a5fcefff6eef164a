"""Is a published entry still what its manifest recorded? Checked on every cache hit, and in full by `gc --verify`.

Every output file's size and sha256 are in the entry's manifest. Re-hashing them on every hit costs about 0.6 s per
GiB here (a cached rerun of the default build reads 1.6 GiB: ~1 s), so a hit hashes a file only when its stat
(size, inode, mtime, ctime) differs from the stamp taken the last time it was hashed. Any write to a file moves its
ctime, which no tool can set back, so a file changed through the filesystem is always re-hashed; damage that
bypasses the filesystem (the disk itself) is what `gc --verify` is for: it hashes everything.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.store.files import MANIFEST, sha256_file, write_json_atomic


def _stat_stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def problems(entry: Path, manifest: dict, stamps: dict | None = None) -> list[str]:
    """What differs between an entry's files and its manifest; [] when intact. `stamps` (file -> stat stamp of its
    last hash) lets unchanged files skip the hash; None hashes every file."""
    recorded = manifest.get("outputs") or {}
    found = {p.relative_to(entry).as_posix() for p in entry.rglob("*") if p.is_file() and p.name != MANIFEST}
    out = [f"{name}: missing" for name in sorted(set(recorded) - found)]
    out += [f"{name}: not in the manifest" for name in sorted(found - set(recorded))]
    for name in sorted(set(recorded) & found):
        path, want = entry / name, recorded[name]
        size = path.stat().st_size
        if size != want["bytes"]:
            out.append(f"{name}: {size} bytes, the manifest recorded {want['bytes']}")
        elif stamps is None or stamps.get(name) != _stat_stamp(path):
            actual = sha256_file(path)
            if actual != want["sha256"]:
                out.append(f"{name}: sha256 {actual[:16]}..., the manifest recorded {want['sha256'][:16]}...")
    return out


def stamps_of(entry: Path, manifest: dict) -> dict:
    """The stat stamp of every output file (take it right after the files were hashed)."""
    return {name: _stat_stamp(entry / name) for name in manifest.get("outputs") or {} if (entry / name).is_file()}


class Stamps:
    """The stamps of the store's entries, one small JSON file per entry under cache/.stamps/ (outside the entry,
    whose file list the manifest fixes)."""

    def __init__(self, cache: Path):
        self.dir = cache / ".stamps"

    def _path(self, stage: str, key: str) -> Path:
        return self.dir / f"{stage}-{key}.json"

    def get(self, stage: str, key: str) -> dict:
        try:
            return json.loads(self._path(stage, key).read_text())
        except (OSError, ValueError):
            return {}

    def put(self, stage: str, key: str, stamps: dict) -> None:
        """Best effort: without a stamp the next hit only hashes again (a full disk must not fail a finished build)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self._path(stage, key), stamps)
        except OSError:
            pass

    def drop(self, stage: str, key: str) -> None:
        try:
            os.unlink(self._path(stage, key))
        except FileNotFoundError:
            pass
