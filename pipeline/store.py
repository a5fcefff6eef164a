"""Content-addressed stage cache under outputs/cache/<stage>/<key>/.

An entry is built in a temp dir next to its final place and published with one rename; it counts
only if its manifest.json says status "ok". A per-key file lock makes concurrent builders of the same
entry build it once; a crashed builder leaves only a temp dir, which the next builder removes.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1


def sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(bufsize):
            h.update(block)
    return h.hexdigest()


def stable_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def read_manifest(entry: Path) -> Optional[dict]:
    try:
        return json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def describe_outputs(entry: Path) -> dict:
    """sha256 and size of every file in an entry (the manifest itself excluded)."""
    out = {}
    for p in sorted(entry.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(entry).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)

    def entry(self, stage: str, key: str) -> Path:
        return self.root / "cache" / stage / key

    def lookup(self, stage: str, key: str) -> Optional[Path]:
        entry = self.entry(stage, key)
        m = read_manifest(entry)
        return entry if m and m.get("status") == "ok" and m.get("key") == key else None

    @contextmanager
    def lock(self, stage: str, key: str) -> Iterator[None]:
        lock_dir = self.root / "cache" / ".locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / f"{stage}-{key}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def new_temp(self, stage: str, key: str) -> Path:
        parent = self.root / "cache" / stage
        parent.mkdir(parents=True, exist_ok=True)
        # we hold the key's lock, so any older temp dir of this key belongs to a dead builder
        for stale in parent.glob(f".tmp-{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = parent / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def publish(self, tmp: Path, stage: str, key: str) -> Path:
        """Move a finished temp dir (with an ok manifest) into place atomically."""
        final = self.entry(stage, key)
        if final.exists():
            # a leftover without an ok manifest (e.g. from an older layout): it does not exist as an entry
            trash = final.with_name(f".trash-{key}-{uuid.uuid4().hex[:8]}")
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        return final

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
