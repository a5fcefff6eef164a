"""Files of the stage cache: atomic JSON, hashes, and the manifest every entry carries."""
from __future__ import annotations

import hashlib
import io
import json
import os
import time
import uuid
from pathlib import Path
from typing import Optional

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
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. disk full: leave no half-written temp file behind
        raise


class _ErrorsLater(io.RawIOBase):
    """A file whose write errors are held until the writer is done (see write_streaming)."""

    def __init__(self, f):
        super().__init__()
        self.f, self.error = f, None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:  # torch.export.save asks (a warning otherwise)
        return self.f.seekable()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def write(self, data) -> int:
        if self.error is None:
            try:
                self.f.write(data)
            except OSError as e:
                self.error = e
        return memoryview(data).nbytes

    def flush(self) -> None:
        if self.error is None:
            try:
                self.f.flush()
            except OSError as e:
                self.error = e


def write_streaming(path: Path, save) -> None:
    """`save(file)` straight to `path`, raising the first OSError (e.g. disk full) once `save` returns. torch's zip
    writer aborts the whole process when a write fails under it (std::terminate in its destructor), so it is given a
    file that never fails: after an error it takes the rest without writing it. No copy of the file in RAM."""
    with open(path, "wb") as f:
        sink = _ErrorsLater(f)
        save(sink)
        sink.flush()
    if sink.error is not None:
        raise sink.error


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


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
