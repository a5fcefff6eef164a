"""torch.export without the optimisation of a guard function export never runs.

Why: strict export captures the program with dynamo, which builds its guards, among them one Python function
holding every symbolic-shape guard (one or more per parameter). Before compiling it, dynamo runs a common
subexpression pass over its code (parse, count and unparse every sub-expression): 20 s of SmolLM2's 60 s export.
Export checks its constraints with those guards and then drops them; without the pass the function holds the same
conditions, written out in full. tests/exporters/test_lean_lowering.py holds the exported program to the stock one.
"""
from __future__ import annotations

import contextlib

from torch._dynamo import guards


@contextlib.contextmanager
def without_guard_cse():
    saved = guards.PyExprCSEPass.count, guards.PyExprCSEPass.replace
    guards.PyExprCSEPass.count = lambda self, exprs: None
    guards.PyExprCSEPass.replace = lambda self, expr: ([], expr)
    try:
        yield
    finally:
        guards.PyExprCSEPass.count, guards.PyExprCSEPass.replace = saved
