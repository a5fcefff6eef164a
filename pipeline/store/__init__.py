"""Content-addressed stage cache under outputs/cache/<stage>/<key>/.

An entry is built in a temp dir next to its final place and published with one rename; it counts
only if its manifest.json says status "ok". A per-key file lock makes concurrent builders of the same
entry build it once; a crashed builder leaves only a temp dir, which the next builder removes.
The key of an entry is computed by pipeline/store/key.py; pipeline/store/gc.py removes what no build reaches.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Optional

from pipeline.store.files import read_manifest


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.cache = self.root / "cache"

    def entry(self, stage: str, key: str) -> Path:
        return self.cache / stage / key

    def lookup(self, stage: str, key: str) -> Optional[Path]:
        entry = self.entry(stage, key)
        m = read_manifest(entry)
        return entry if m and m.get("status") == "ok" and m.get("key") == key else None

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
        return final

    def remove(self, path: Path, key: str, tag: str = "") -> None:
        """Rename away, then delete: a reader never sees half an entry."""
        trash = path.with_name(f".trash-{key}-{uuid.uuid4().hex[:8]}{tag}")
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
