"""The exported program handed from export to lower in memory, when one build runs both in one process.

Why: loading program.pt2 back re-traces every node with fake tensors (SmolLM2: ~10 s of a cold build's lower
stage). The program is handed over only if the file lower is asked to read is the very file export wrote (same
inode, size and modification time: the store publishes an entry by renaming its directory); anything else, a
cache hit or another process's entry, is loaded from the file. A deserialized program lowers to the same bytes
(tests/exporters/test_handoff.py).
"""
from __future__ import annotations

import os
from pathlib import Path

_kept: dict = {}
STATS = {"handed": 0}  # programs lower took from memory (the tests read it)


def _identity(path: Path) -> tuple:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def keep(path: Path, program) -> None:
    """Hold `program`, the one just written to `path` (only the latest: an earlier one is dropped)."""
    _kept.clear()
    _kept[_identity(path)] = program


def take(path: Path):
    """The program written to `path` by this process's last export, once (None: load it from the file)."""
    try:
        key = _identity(path)
    except OSError:
        return None
    program = _kept.pop(key, None)
    _kept.clear()
    STATS["handed"] += program is not None
    return program
