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


def write_via_memory(path: Path, save) -> None:
    """`save(file)` into memory, then one plain write to `path`. torch's zip writer aborts the whole process when the
    disk fills mid-write (std::terminate in its destructor); a plain write fails with a clean OSError instead.
    Costs a transient copy of the file in RAM."""
    buf = io.BytesIO()
    save(buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


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
