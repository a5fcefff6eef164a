"""Content-addressed stage cache under outputs/cache/<stage>/<key>/.

An entry is built in a temp dir next to its final place and published with one rename; it counts
only if its manifest.json says status "ok" and its files still are what the manifest recorded
(pipeline/store/integrity.py; a damaged entry is moved to cache/.quarantine/ with the reason, never
deleted, and rebuilt). A per-key file lock makes concurrent builders of the same entry build it once;
a crashed builder leaves only a temp dir, which the next builder removes.
The key of an entry is computed by pipeline/store/key.py; pipeline/store/gc.py removes what no build reaches.
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Optional

from pipeline.store import integrity
from pipeline.store.files import read_manifest, stable_hash, write_json_atomic

log = logging.getLogger(__name__)


def outputs_digest(entry: Path) -> Optional[str]:
    """One hash of what an entry's manifest records of its files: a downstream entry notes it for each input."""
    m = read_manifest(entry)
    return stable_hash(m["outputs"]) if m and "outputs" in m else None


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.cache = self.root / "cache"
        self.quarantine_dir = self.cache / ".quarantine"
        self.stamps = integrity.Stamps(self.cache)

    def entry(self, stage: str, key: str) -> Path:
        return self.cache / stage / key

    def lookup(self, stage: str, key: str, inputs: Optional[dict] = None) -> Optional[Path]:
        """The entry if it exists: an ok manifest, its files intact, built from the input entries given (name ->
        path) as they are now."""
        entry = self.entry(stage, key)
        m = read_manifest(entry)
        if not (m and m.get("status") == "ok" and m.get("key") == key):
            return None
        return None if self.damage(stage, key, m, inputs) else entry

    def damage(self, stage: str, key: str, m: dict, inputs: Optional[dict] = None,
               trust_stamps: bool = True) -> list[str]:
        """Why a published entry can no longer be served ([] if it can); refreshes the stamps of intact files.
        `trust_stamps=False` hashes every file (gc --verify)."""
        entry = self.entry(stage, key)
        stamps = self.stamps.get(stage, key)
        found = integrity.problems(entry, m, stamps if trust_stamps else None)
        for up, path in (inputs or {}).items():
            recorded = (m.get("inputs") or {}).get(up, {}).get("outputs")
            if recorded is not None and recorded != outputs_digest(path):
                found.append(f"built from {up}/{Path(path).name[:12]}, whose files have changed since")
        if not found:
            now = integrity.stamps_of(entry, m)
            if now != stamps:
                self.stamps.put(stage, key, now)
        return found

    def quarantine_damaged(self, stage: str, key: str, inputs: Optional[dict] = None) -> Optional[dict]:
        """Under the key's lock: move a damaged entry to cache/.quarantine/ (with why.json) so it gets rebuilt.
        Returns {path, problems} if it did."""
        entry = self.entry(stage, key)
        m = read_manifest(entry)
        if not (m and m.get("status") == "ok" and m.get("key") == key):
            return None
        found = self.damage(stage, key, m, inputs)
        if not found:
            return None
        dest = self.quarantine(stage, key, found)
        log.warning("cache entry %s/%s is damaged (%s): moved to %s; rebuilding", stage, key[:12],
                    "; ".join(found), dest)
        return {"path": str(dest), "problems": found}

    def quarantine(self, stage: str, key: str, problems: list[str]) -> Path:
        """Under the key's lock: move an entry out of the cache, keeping it (and why) for a human to look at."""
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        dest = self.quarantine_dir / f"{stage}-{key}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        os.rename(self.entry(stage, key), dest)
        write_json_atomic(dest.with_name(dest.name + ".why.json"), {
            "stage": stage, "key": key, "problems": problems, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        self.stamps.drop(stage, key)
        return dest

    def _lock_file(self, stage: str, key: str) -> IO:
        lock_dir = self.cache / ".locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        return open(lock_dir / f"{stage}-{key}.lock", "w")

    @contextmanager
    def lock(self, stage: str, key: str) -> Iterator[None]:
        with self._lock_file(stage, key) as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def try_lock(self, stage: str, key: str) -> Optional[IO]:
        """The key's lock without waiting (close the returned file to release it); None if it is held."""
        f = self._lock_file(stage, key)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        return f

    def new_temp(self, stage: str, key: str) -> Path:
        parent = self.cache / stage
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
            self.remove(final, key)
        os.rename(tmp, final)
        # the files were hashed into the manifest just now: stamp them so the next hit need not hash them again
        self.stamps.put(stage, key, integrity.stamps_of(final, read_manifest(final) or {}))
        return final

    def remove(self, path: Path, key: str, tag: str = "") -> None:
        """Rename away, then delete: a reader never sees half an entry."""
        trash = path.with_name(f".trash-{key}-{uuid.uuid4().hex[:8]}{tag}")
        os.rename(path, trash)
        self.stamps.drop(path.parent.name, key)
        shutil.rmtree(trash, ignore_errors=True)

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
