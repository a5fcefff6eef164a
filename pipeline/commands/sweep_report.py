"""Rewrite the report of a sweep (`python -m pipeline -m ...` writes it at the end; pipeline/report/sweep.py).

    python -m pipeline sweep_report outputs/sweeps/20261129-120000
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from pipeline.report.sweep import report


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m pipeline sweep_report SWEEP_DIR", file=sys.stderr)
        return 2
    _, paths = report(Path(args[0]))
    print(f"report: {paths['md']}")
    return 0
