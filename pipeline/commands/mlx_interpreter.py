"""List an MLX program's instructions and whether our interpreter (pipeline/runtimes/mlx) covers each.

    python -m pipeline mlx_interpreter model.pte [more.pte ...]     # exit 1 if any instruction is uncovered
"""
from __future__ import annotations

import sys

from pipeline.runtimes.mlx.ops import Interpreter
from pipeline.runtimes.mlx.program import coverage


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    bad = 0
    for p in argv:
        cov = coverage(p)
        print(f"{p}: {sum(cov['instructions'].values())} instructions, {len(cov['instructions'])} kinds")
        for op, c in sorted(cov["instructions"].items(), key=lambda x: -x[1]):
            print(f"  {op:<24} {c:5d}  {'ok' if Interpreter.covers(op) else 'UNSUPPORTED'}")
        bad += len(cov["uncovered"])
    return 1 if bad else 0
