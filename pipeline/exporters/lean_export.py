"""torch.export without the optimisation of a guard function export never runs, and torch.export.save without a
self-test whose result it drops.

Why: strict export captures the program with dynamo, which builds its guards, among them one Python function
holding every symbolic-shape guard (one or more per parameter). Before compiling it, dynamo runs a common
subexpression pass over its code (parse, count and unparse every sub-expression): 20 s of SmolLM2's 60 s export.
Export checks its constraints with those guards and then drops them; without the pass the function holds the same
conditions, written out in full. tests/exporters/test_lean_lowering.py holds the exported program to the stock one.

torch.export.save serializes the program, then canonicalizes a deep copy of it "to test the canonical form is well
defined" and drops the result: 3 of SmolLM2's 5 s of saving. The test holds the file to the stock save's bytes.
"""
from __future__ import annotations

import contextlib

from torch._dynamo import guards
from torch._export.serde import serialize


@contextlib.contextmanager
def without_guard_cse():
    saved = guards.PyExprCSEPass.count, guards.PyExprCSEPass.replace
    guards.PyExprCSEPass.count = lambda self, exprs: None
    guards.PyExprCSEPass.replace = lambda self, expr: ([], expr)
    try:
        yield
    finally:
        guards.PyExprCSEPass.count, guards.PyExprCSEPass.replace = saved


@contextlib.contextmanager
def without_canonical_self_test():
    saved = serialize.canonicalize
    serialize.canonicalize = lambda ep, constants=None: ep  # its only caller ignores what it returns
    try:
        yield
    finally:
        serialize.canonicalize = saved
