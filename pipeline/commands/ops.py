"""`python -m pipeline ops`: the operators a .pte calls and the library that provides each, the operators this
process resolves, our kernels' ISA path (pipeline/ops.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.ops import DELEGATES, describe, isa, isa_paths, library, load, program_operators, read_program, \
    registered, requirements

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline ops", description=__doc__.split("\n\n")[0])
    ap.add_argument("pte", nargs="?", help="a .pte: its operators and the library that provides each")
    ap.add_argument("--registered", action="store_true", help="the operators this process resolves after load()")
    ap.add_argument("--isa", action="store_true", help="our kernels' ISA path here (LLMPIPE_ISA forces one)")
    args = ap.parse_args(argv)
    try:
        return _main(args, ap)
    except RuntimeError as e:  # a bad LLMPIPE_ISA, a library that will not load: one line
        print(f"error: {e}", file=sys.stderr)
        return 1


def _main(args, ap) -> int:
    if args.isa:
        print(f"{isa()}; paths here: {', '.join(isa_paths())}")
        return 0
    if args.registered:
        load()
        print("\n".join(registered()))
        return 0
    if not args.pte:
        ap.error("give a .pte or --registered")
    ops_, delegates = program_operators(read_program(Path(args.pte)))
    for op in ops_:
        print(f"{op:55s} {library(op).link}")
    for d in delegates:
        print(f"{'delegate ' + d:55s} {DELEGATES.get(d, d)}")
    req = requirements(ops_, delegates)
    print("runs on ExecuTorch's stock libraries alone" if req["stock_only"] else
          f"runs on {describe(req)}" if not req["needs_ours"] else
          f"needs beyond ExecuTorch's stock libraries: {', '.join(sorted(set(req['beyond_stock'].values())))}")
    return 0
