"""The grammar for the C++ runner (llm_runner --json-schema / --grammar), over a pipe: no grammar engine on PyPI ships
its C or C++ interface (llguidance's wheel holds its Python extension only, xgrammar's its nanobind module, outlines-
core's its PyO3 module), so the runner starts this process and asks it, a line at a time on stdin:

    M            -> the allowed-token bitmask: vocab / 32 little-endian uint32 words, raw, on stdout
    C <token>    -> "ok" (the token taken) or "error <why>"
    V <t1,t2,..> -> how many of the draft's first tokens the grammar accepts, as a line (nothing taken)
    S            -> "1" when the grammar has ended (its end-of-text token was taken), else "0"
    A            -> "1" when the output so far is complete (the grammar may end here), else "0"
    R            -> a fresh grammar state (a new turn): "ok"

It first prints "ready <vocab>", or "error <why>" and exits 2 (a bad schema or grammar, before any token).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline constrain_sidecar", description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True, help="the build's tokenizer.json")
    ap.add_argument("--vocab", type=int, required=True, help="the program's vocabulary size")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--json-schema")
    g.add_argument("--grammar")
    args = ap.parse_args(argv)
    out = sys.stdout.buffer
    try:
        from transformers import PreTrainedTokenizerFast

        from pipeline.generation.constrain import Constraint, ConstraintError, grammar_text, tokenizer_for
        grammar = grammar_text(args.json_schema and Path(args.json_schema), args.grammar and Path(args.grammar))
        tok = tokenizer_for(PreTrainedTokenizerFast(tokenizer_file=args.tokenizer), args.vocab)
        c = Constraint(grammar, tok, args.vocab)
    except (ConstraintError, OSError, ValueError) as e:
        out.write(f"error {e}\n".encode())
        out.flush()
        return 2
    import llguidance.torch as llt
    words = (args.vocab + 31) // 32
    out.write(f"ready {args.vocab}\n".encode())
    out.flush()
    for line in sys.stdin.buffer:
        cmd, _, arg = line.decode().strip().partition(" ")
        if cmd == "M":
            llt.fill_next_token_bitmask(c.matcher, c.bitmask, 0)
            out.write(c.bitmask[0, :words].numpy().astype("<i4").tobytes())
        elif cmd == "C":
            try:
                c.consume(int(arg))
                out.write(b"ok\n")
            except ConstraintError as e:
                out.write(f"error {e}\n".encode())
        elif cmd == "V":
            draft = [int(t) for t in arg.split(",")] if arg else []
            out.write(f"{len(c.valid_prefix(draft))}\n".encode())
        elif cmd == "S":
            out.write(b"1\n" if c.done else b"0\n")
        elif cmd == "A":
            out.write(b"1\n" if c.complete else b"0\n")
        elif cmd == "R":
            c = Constraint(grammar, tok, args.vocab)
            out.write(b"ok\n")
        else:
            out.write(f"error unknown command {cmd!r}\n".encode())
        out.flush()
    return 0
