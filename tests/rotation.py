"""The slow tier's rotation and its record.

Every run of the CI tier (`pytest -q`, which `.ci/run` runs) also runs one of SHARES shares of the slow tier: the
share is the checkout's commit count modulo SHARES, so SHARES consecutive commits run every slow test once. A share
holds whole units: a test file's slow tests together (they share its module fixtures and real-model builds), except in
the files that set `ROTATE_EACH_TEST = True` (independent builds), where each test is a unit.

Heavy units (a real-model build, or a module that sets `ROTATION_HEAVY = True`) are dealt one to a share in the order of
their names, so no share carries two while there are no more of them than shares; the light ones go by a hash of
their name. A unit's share moves only when a heavy unit is added or removed before it.

Every slow test that passes is written to RECORD (its date and commit) and docs/testing.md's table is drawn from it,
so a slow test that stopped running, or stopped passing, shows its age there.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARES = 32
RECORD = ROOT / "tests" / "slow_tier.json"
DOC = ROOT / "docs" / "testing.md"
BEGIN, END = "<!-- slow-tier record: begin -->", "<!-- slow-tier record: end -->"
# LLMPIPE_SLOW_SHARE=K runs share K instead of the commit's; =none runs no share
ENV = "LLMPIPE_SLOW_SHARE"


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def current_share() -> int | None:
    """The share this run takes: LLMPIPE_SLOW_SHARE, else the commit count modulo SHARES (outside a git checkout,
    the day's ordinal)."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() == "none":
        return None
    if value:
        if not value.isdigit() or int(value) >= SHARES:
            raise ValueError(f"{ENV}={value!r}: expected a share 0..{SHARES - 1} or 'none'")
        return int(value)
    count = _git("rev-list", "--count", "HEAD")
    return int(count) % SHARES if count else datetime.date.today().toordinal() % SHARES


def unit(nodeid: str, each_test: bool) -> str:
    """The rotation unit of a test: its file, or the test itself (parametrization included) in a per-test file."""
    return nodeid if each_test else nodeid.split("::", 1)[0]


def hashed_share(unit_name: str) -> int:
    return int(hashlib.sha256(unit_name.encode()).hexdigest(), 16) % SHARES


def shares(units: dict[str, bool]) -> dict[str, int]:
    """unit -> its share; `units`: unit -> heavy."""
    heavy = sorted(u for u, h in units.items() if h)
    out = {u: hashed_share(u) for u, h in units.items() if not h}
    out.update({u: i % SHARES for i, u in enumerate(heavy)})
    return out


def item_unit(item) -> str:
    return unit(item.nodeid, bool(getattr(item.module, "ROTATE_EACH_TEST", False)))


def item_heavy(item) -> bool:
    return item.get_closest_marker("real_model") is not None or bool(getattr(item.module, "ROTATION_HEAVY", False))


# ---- the record: which slow test last passed, when, at which commit ----------------------------------------------

def load_record() -> dict:
    return json.loads(RECORD.read_text()) if RECORD.exists() else {}


def update_record(passed: list[str], slow: list[str] | None) -> None:
    """Writes the passed slow tests into the record, and docs/testing.md's table from it. `slow`: every slow test
    (when the whole suite was collected): the record then lists the ones that never passed and drops removed ones."""
    if not passed:  # a run that passed no slow test (the CI tier alone, a collection) changes nothing
        return
    record = load_record()
    if slow is not None:
        record = {n: record.get(n, {"passed": None, "commit": None}) for n in slow}
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--untracked-files=no", "--", "pipeline", "native", "tests", "conf", "recipes"):
        head += "+changes"
    today = datetime.date.today().isoformat()
    for nodeid in passed:
        record[nodeid] = {"passed": today, "commit": head}
    RECORD.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n")
    write_table(record)


def _function(nodeid: str) -> str:
    return re.sub(r"\[.*\]$", "", nodeid)


def table(record: dict) -> str:
    """One row per slow test function (its parametrized cases together): how many cases, the oldest pass among them
    (never, if a case has none), the newest."""
    rows: dict[str, list[str | None]] = {}
    for nodeid, entry in sorted(record.items()):
        rows.setdefault(_function(nodeid), []).append(entry["passed"])
    lines = ["| slow test | cases | oldest last pass | newest |", "|---|---|---|---|"]
    for function, dates in rows.items():
        known = [d for d in dates if d]
        oldest = "never" if len(known) < len(dates) else min(known)
        lines.append(f"| `{function}` | {len(dates)} | {oldest} | {max(known) if known else 'never'} |")
    return "\n".join(lines)


def write_table(record: dict) -> None:
    text = DOC.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    DOC.write_text(text[:start] + "\n" + table(record) + "\n" + text[end:])
