"""`python -m pipeline generate`: token-by-token generation from a built program, in Python (the reference's
run_llm_hf).

    python -m pipeline generate --prompt "What is the capital of France?"      # the default build's latest
    python -m pipeline generate --recipe smollm2_stock --prompt "..."             # a recipe's latest build
    python -m pipeline generate --run outputs/runs/<time> --interactive         # a chat; /reset, /quit
    python -m pipeline generate --pte <lower entry>/model.pte --model-dir <dir> --prompt "..." --temperature 0.7

The program runs where verify runs it (pipeline/generation/runner.py). Text streams to stdout; the timings and a
`STATS_JSON: {...}` line (the C++ runner's keys) go to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pipeline import abi
from pipeline.generation.builds import resolve
from pipeline.generation.runner import Sampler, Session, Stream, Text, open_for_generation


def report(stats: dict, err=sys.stderr) -> None:
    decode = f"{stats['decode_tok_s']} tok/s" if stats["decode_tok_s"] else "-"
    print(f"\n[stats] prompt {len(stats['prompt_ids'])} tokens ({stats['prompt_tokens_fed']} fed), generated "
          f"{len(stats['generated_ids'])} ({stats['stop_reason']}); TTFT {stats['ttft_ms']} ms, prefill "
          f"{stats['prefill_tok_s']} tok/s, decode {decode}", file=err)
    if stats.get("constraint"):
        print(f"[grammar] {stats['constraint']['masks']} masks, {stats['constraint']['mask_ms_per_token']} ms per "
              "token", file=err)
        if not stats["constraint"]["complete"]:
            limit = "token limit (--max-new-tokens)" if stats["stop_reason"] == "length" else "context's end"
            print(f"[grammar] warning: the output is incomplete: the {limit} came before the grammar's end, so it may "
                  "not parse (raise --max-new-tokens, or give the schema fewer or shorter fields)", file=err)
    spec = stats.get("speculation")
    if spec:
        vs = (f"; {spec['speedup']}x the plain run's {spec['plain_decode_tok_s']} tok/s"
              f"{'' if spec['identical'] is None else ', tokens identical' if spec['identical'] else ', tokens differ'}"
              if "speedup" in spec else "")
        print(f"[speculate] drafted {spec['drafted']}, accepted {spec['accepted']} ({spec['acceptance']}) in "
              f"{spec['verify_steps']} verify steps{vs}", file=err)
    print("STATS_JSON: " + json.dumps(stats), file=err, flush=True)


def turn(session: Session, text: Text, messages: list[dict], args, sample, history: list[int] = ()) -> dict:
    stream = Stream(text, session.eos)
    ids = text.prompt_ids(messages, history)
    if args.grammar_text is not None:  # a fresh grammar state each turn
        from pipeline.generation.constrain import Constraint, tokenizer_for
        if getattr(args, "lltokenizer", None) is None:
            args.lltokenizer = tokenizer_for(text.fast_tokenizer(), session.vocab)
        sample.constraint = Constraint(args.grammar_text, args.lltokenizer, session.vocab)
    stats = session.generate(ids, args.max_new_tokens, sample, stream)
    stats["text"] = stream.shown
    if session.speculation is not None and args.compare_plain:
        plain = compare_plain(session, ids, args)
        stats["speculation"].update(plain)
    report(stats)
    return stats


def compare_plain(session: Session, ids: list[int], args) -> dict:
    """The same turn again without speculation, from an empty cache: its decode speed, and for a greedy run whether
    its tokens are the same (they must be). The session's cache holds the plain run afterwards."""
    first = dict(session.last)
    speculation, session.speculation = session.speculation, None
    try:
        session.reset()
        constraint = None
        if args.grammar_text is not None:  # the plain run under the same grammar
            from pipeline.generation.constrain import Constraint
            constraint = Constraint(args.grammar_text, args.lltokenizer, session.vocab)
        plain = session.generate(ids, args.max_new_tokens, Sampler(args.temperature, args.top_k, args.top_p,
                                                                  args.seed, constraint))
    finally:
        session.speculation = speculation
    rate = plain["decode_tok_s"]
    return {"plain_decode_tok_s": rate,
            "speedup": round(first["decode_tok_s"] / rate, 2) if rate and first["decode_tok_s"] else None,
            "identical": plain["generated_ids"] == first["generated_ids"] if args.temperature <= 0 else None}


def interactive(session: Session, text: Text, args, sample) -> None:
    messages: list[dict] = []
    history: list[int] = []  # every token of the conversation so far, the replies as generated
    print("interactive: a line per turn; /reset forgets the conversation, /quit ends", file=sys.stderr)
    for line in sys.stdin:
        line = line.rstrip("\n")
        if line.strip() == "/quit":
            break
        if line.strip() == "/reset":
            messages, history = [], []
            session.reset()
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            stats = turn(session, text, messages, args, sample, history)
        except ValueError as e:  # the conversation outgrew the context: say so, keep the session
            print(f"error: {e}; /reset to start again", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": stats["text"]})
        history = stats["prompt_ids"] + stats["generated_ids"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pipeline generate", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--run", help="a run manifest (or its directory); default: the default composition's latest "
                                   "successful build (`python -m pipeline`)")
    src.add_argument("--recipe", help="the latest successful build of this recipe, as composed (no overrides)")
    src.add_argument("--pte", help="a .pte (a lower entry's, or any: then --model-dir or --tokenizer)")
    ap.add_argument("--model-dir", help="the model folder: tokenizer and chat template (with --pte)")
    ap.add_argument("--tokenizer", help="a tokenizer.json (with --pte; no chat template: raw prompts)")
    ap.add_argument("--prompt", help="one prompt (or --interactive)")
    ap.add_argument("--interactive", action="store_true", help="a conversation on stdin")
    ap.add_argument("--chat", choices=("auto", "template", "raw"), default="auto",
                    help="auto: the model's chat template when it has one; raw: the prompt as text")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--speculate", choices=("off", "ngram"), default="off",
                    help="ngram: prompt-lookup speculative decoding (drafts from the context, verified in one forward; "
                         "needs a program built with export.logits_mode=tail, selected or full)")
    ap.add_argument("--draft-max", type=int, default=3,
                    help="most tokens drafted a step (< the program's chunk); above 3, greedy output may differ from "
                         "plain decoding at near-ties (wider verify steps run other kernels)")
    ap.add_argument("--ngram-min", type=int, default=2, help="shortest n-gram a draft is matched on")
    ap.add_argument("--ngram-max", type=int, default=4, help="longest n-gram a draft is matched on")
    ap.add_argument("--compare-plain", action="store_true",
                    help="with --speculate: run each turn again without it and report the speedup")
    constrain = ap.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", help="a JSON schema file: the output is JSON that validates against it")
    constrain.add_argument("--grammar", help="a grammar file, GBNF (with ::=) or Lark: the output parses by it")
    ap.add_argument("--kv-max-capacity", type=int, help="runtime-owned cache: positions (default: the context)")
    ap.add_argument("--kv-initial-capacity", type=int, help="runtime-owned cache: flat pools start here")
    ap.add_argument("--kv-windows", help="runtime-owned cache: a window pattern, e.g. 512,512,0 (0 = flat)")
    ap.add_argument("--kv-storage-dtype", choices=sorted(abi.KV_DTYPES), help="runtime-owned cache storage")
    ap.add_argument("--huge-pages", choices=("on", "off"), default="on",
                    help="back the weights XNNPACK packs and the KV cache with 2 MiB pages after the load (Linux >= "
                         "6.1): faster decode (default: on)")
    return ap


def cache_policy(args):
    from pipeline.runtimes.base import CachePolicy
    policy = CachePolicy(capacity=args.kv_max_capacity,
                         windows=[int(w) for w in args.kv_windows.split(",")] if args.kv_windows else None,
                         kv_dtype=abi.KV_DTYPES[args.kv_storage_dtype] if args.kv_storage_dtype else None)
    if args.kv_initial_capacity is not None:
        policy.initial_capacity = args.kv_initial_capacity
    return policy


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    # torch here only samples from a row of logits; its OpenMP workers spin between those calls and took ~20 % of
    # the two cores from the program's own thread pool (perf, SmolLM2 decode: 6.2 -> 4.9 ms a step)
    torch.set_num_threads(1)
    if (args.prompt is None) == (not args.interactive):
        print("error: give --prompt or --interactive (one of them)", file=sys.stderr)
        return 2
    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        print("error: --max-new-tokens >= 1, --temperature >= 0, --top-k >= 0, 0 < --top-p <= 1", file=sys.stderr)
        return 2
    pte, model_dir, tokenizer = resolve(args)
    if not pte.exists():
        print(f"error: {pte}: no such program", file=sys.stderr)
        return 1
    args.grammar_text = None
    if args.json_schema or args.grammar:  # a bad schema or grammar is refused before the program loads
        from pipeline.generation.constrain import ConstraintError, grammar_text
        try:
            args.grammar_text = grammar_text(args.json_schema and Path(args.json_schema),
                                             args.grammar and Path(args.grammar))
        except ConstraintError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    speculation = None
    if args.speculate == "ngram":
        from pipeline.generation.speculate import EXACT_ROWS, Speculation
        if args.draft_max < 1 or not 1 <= args.ngram_min <= args.ngram_max:
            print(f"error: --draft-max {args.draft_max} must be >= 1 and --ngram-min {args.ngram_min} <= --ngram-max "
                  f"{args.ngram_max}, both >= 1", file=sys.stderr)
            return 2
        speculation = Speculation(args.draft_max, args.ngram_min, args.ngram_max)
        if args.draft_max > EXACT_ROWS - 1:
            print(f"[speculate] --draft-max {args.draft_max}: verify steps wider than {EXACT_ROWS} rows run other "
                  "kernels, whose logits differ from a decode step's by rounding: greedy output may differ from "
                  "plain decoding at near-ties", file=sys.stderr)
    text = Text(model_dir, tokenizer, args.chat)
    try:
        session = Session(open_for_generation(pte, cache_policy(args)), speculation)
    except (RuntimeError, ValueError) as e:
        print(f"error: cannot run {pte}: {e}", file=sys.stderr)
        return 1
    huge = 0
    if args.huge_pages == "on":
        from pipeline.ops import back_with_huge_pages
        huge = back_with_huge_pages()
    print(f"[program] {pte} (context {session.context}, chunk {session.chunk}, {huge / 2**20:.0f} MiB on 2 MiB "
          f"pages)", file=sys.stderr)
    sample = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    if args.interactive:
        interactive(session, text, args, sample)
        return 0
    try:
        turn(session, text, [{"role": "user", "content": args.prompt}], args, sample)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
