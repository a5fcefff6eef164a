"""python -m pipeline.generate: token-by-token generation from a built program, in Python (the reference's run_llm_hf).

    python -m pipeline.generate --prompt "What is the capital of France?"      # the default build's latest
    python -m pipeline.generate --recipe smollm2_stock --prompt "..."             # a recipe's latest build
    python -m pipeline.generate --run outputs/runs/<time> --interactive         # a chat; /reset, /quit
    python -m pipeline.generate --pte <lower entry>/model.pte --model-dir <dir> --prompt "..." --temperature 0.7 --seed 1

The program runs where verify runs it (pipeline/runtimes: the ExecuTorch runtime, its runtime-owned cache for
off-graph programs, the MLX interpreter, the transformers route's prefill/decode pair). Text streams to stdout; the
timings and a `STATS_JSON: {...}` line (the C++ runner's keys) go to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from pipeline import abi
from pipeline.builds import resolve


def open_for_generation(pte: Path, policy):
    """A lower entry's program in its recorded runtime; a bare .pte in the ExecuTorch runtime."""
    from pipeline.runtimes import LOWERED, RUNTIMES, open_program
    from pipeline.runtimes.base import RunnerProgram
    folder = pte if pte.is_dir() else pte.parent
    if (folder / LOWERED).exists():
        return open_program(folder, policy=policy)
    return RunnerProgram(RUNTIMES["executorch"], pte, policy, kernels=("llmpipe", "llama"))  # whichever it calls


class Sampler:
    """Greedy at temperature 0; otherwise temperature, then top-k, then top-p (nucleus), from a seeded generator."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 constraint=None):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.gen = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns() % 2**31))
        self.constraint = constraint  # pipeline/constrain.py: the grammar masks the logits and takes each token

    def __call__(self, logits: torch.Tensor) -> int:
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        if self.temperature <= 0:
            token = int(logits.argmax())
        else:
            probs = self.probs(logits)
            token = int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))
        if self.constraint is not None:
            self.constraint.consume(token)
        return token

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a token is drawn from (not normalized after top-k / top-p)."""
        probs = torch.softmax(logits.float() / self.temperature, -1)
        if self.top_k > 0:
            kth = torch.topk(probs, min(self.top_k, probs.numel())).values[-1]
            probs = torch.where(probs < kth, 0.0, probs)
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < self.top_p  # the smallest set whose mass reaches top_p
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
        return probs


class Session:
    """A program and the tokens its cache holds; each turn feeds only what the cache does not hold yet."""

    def __init__(self, program, speculation=None):
        self.program = program
        const = program.constant
        self.chunk = getattr(program, "chunk", None) or abi.ints(const(abi.MAX_SEQ_LEN))[0]
        self.verify_rows = getattr(program, "verify_rows", self.chunk)  # the most rows one forward gives logits for
        self.context = abi.ints(const(abi.MAX_CONTEXT_LEN))[0]
        self.eos = set(abi.ints(const(abi.EOS_IDS)))
        self.vocab = abi.ints(const(abi.VOCAB_SIZE))[0]
        self.held: list[int] = []
        self.speculation = speculation
        if speculation is not None:
            why = why_not_speculate(program)
            if not why and speculation.draft_max > self.verify_rows - 1:
                why = (f"--draft-max {speculation.draft_max}: a verify step feeds the drafts after the last token, "
                       f"in one forward of at most {self.verify_rows} rows: at most {self.verify_rows - 1} drafts")
            if why:
                raise ValueError(f"--speculate: {why}")
        self._verified: tuple = ()  # (start, fed, snapshot) of the last verify step

    def _feed(self, ids: list[int]) -> torch.Tensor:
        from pipeline.runtimes.base import run_sequence
        logits = run_sequence(self.program, ids, self.chunk, start=len(self.held))
        self.held += ids
        return logits

    def verify(self, fed: list[int]) -> torch.Tensor:
        """Feeds `fed` in one forward and returns every row's logits [len(fed), V]; keep() then says how many of
        them the cache keeps. A recurrent state is snapshot first: it cannot be rewound."""
        snap = self.program.snapshot()
        start = len(self.held)
        positions = torch.arange(start, start + len(fed), dtype=torch.long)
        rows = self.program(torch.tensor([fed], dtype=torch.long), positions, all_rows=True)[0].float()
        self.held += fed
        self._verified = (start, fed, snap)
        return rows

    def keep(self, m: int) -> None:
        """After verify(fed): the cache keeps fed[:m] and drops the rest."""
        start, fed, snap = self._verified
        if m == len(fed):
            return
        cache = getattr(self.program, "cache", None)
        del self.held[start:]
        if snap is not None:  # back to the state before the verify, then the kept tokens again
            self.program.restore(snap)
            if cache is not None and cache.length > start:  # its attention caches too (no recurrent state of its own)
                cache.rewind(start)
            self._feed(fed[:m])
            return
        if cache is not None:
            cache.rewind(start + m)
        self.held += fed[:m]  # an in-graph cache masks what lies past the next step's positions

    def generate(self, ids: list[int], max_new: int, sample: Callable[[torch.Tensor], int],
                 on_token: Callable[[int], None] = lambda t: None) -> dict:
        """Prefill `ids` (reusing the cache's common prefix), then decode until a stop token, `max_new` tokens or
        the context's end. Returns the C++ runner's report keys."""
        if self.held != ids[:len(self.held)] or len(self.held) == len(ids):
            self.reset()
        if len(ids) >= self.context:
            raise ValueError(f"the prompt has {len(ids)} tokens; the program's context holds {self.context}")
        fed = len(ids) - len(self.held)
        t0 = time.perf_counter()
        token = sample(self._feed(ids[len(self.held):]))
        t1 = time.perf_counter()
        out, stop, spec = [token], "max_new_tokens", None
        constraint = getattr(sample, "constraint", None)
        on_token(token)
        if self.speculation is not None:
            more, stop, spec = self.speculation.decode(self, token, max_new, sample, on_token)
            out += more
        while spec is None:
            if token in self.eos:
                stop = "eos"
                break
            if len(out) >= max_new or len(self.held) >= self.context:
                stop = stop if len(out) >= max_new else "context"
                break
            if constraint is not None and constraint.done:
                stop = "grammar"
                break
            token = sample(self._feed([token]))
            out.append(token)
            on_token(token)
        t2 = time.perf_counter()
        # a token or context limit before the grammar's end: the output may not parse, and the report says so
        complete = constraint is None or stop not in ("max_new_tokens", "context") or constraint.complete
        if not complete and stop == "max_new_tokens":
            stop = "length"
        decoded = len(out) - 1
        stats = {"prompt_ids": ids, "generated_ids": out, "stop_reason": stop, "prompt_tokens_fed": fed,
                 "ttft_ms": round((t1 - t0) * 1e3, 2), "prefill_tok_s": round(fed / max(t1 - t0, 1e-9), 1),
                 "decode_tok_s": round(decoded / (t2 - t1), 1) if decoded else None}
        if spec is not None:
            stats["speculation"] = spec
        if constraint is not None:
            stats["constraint"] = {**constraint.stats(), "complete": complete}
        self.last = stats
        return stats

    def reset(self) -> None:
        self.program.reset()
        self.held = []


def why_not_speculate(program) -> str:
    """Why speculation cannot run on this program ("" when it can): a verify step needs every row's logits and a
    rollback the runtime can do (the drafts' room in a chunk is Session's check)."""
    if not hasattr(program, "rows_logits"):
        return "the transformers route's prefill/decode pair decodes one token a call: build with the runner layout"
    if not program.rows_logits:
        return ("this program returns the last row's logits only (export.logits_mode=last); speculation verifies "
                "a draft in one forward and needs every row's: rebuild with export.logits_mode=tail (or selected, full)")
    if not program.can_snapshot:
        return ("this program keeps its recurrent state inside the program (cache.mode=custom), where this runtime "
                "cannot roll it back: build with cache.mode=offgraph")
    return ""


class Text:
    """The tokenizer side: prompt ids (the model's chat template unless raw) and streamed text."""

    def __init__(self, model_dir: Optional[Path], tokenizer: Optional[Path], chat: str):
        if model_dir is not None:
            from transformers import AutoTokenizer
            self.hf = AutoTokenizer.from_pretrained(model_dir)
            self.decode = lambda ids: self.hf.decode(ids, skip_special_tokens=True)
            self.encode = lambda text: self.hf(text, add_special_tokens=True)["input_ids"]
            self.encode_plain = lambda text: self.hf(text, add_special_tokens=False)["input_ids"]
            self.template = chat != "raw" and bool(self.hf.chat_template)
        elif tokenizer is not None:
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(str(tokenizer))
            self.tokenizer_file = tokenizer
            self.decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
            self.encode = lambda text: tok.encode(text).ids
            self.encode_plain = lambda text: tok.encode(text, add_special_tokens=False).ids
            self.template = False  # a bare tokenizer.json carries no chat template
        else:
            raise SystemExit("error: --pte needs --model-dir (tokenizer and chat template) or --tokenizer")
        if chat == "template" and not self.template:
            raise SystemExit("error: --chat template: this tokenizer has no chat template (use --chat raw)")

    def fast_tokenizer(self):
        """A transformers tokenizer of it (what the grammar engine reads the vocabulary from)."""
        if hasattr(self, "hf"):
            return self.hf
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast(tokenizer_file=str(self.tokenizer_file))

    def prompt_ids(self, messages: list[dict], history: list[int] = ()) -> list[int]:
        """The ids of a turn: the whole rendering for the first; later turns append only what the template adds
        after the conversation so far to the tokens already in it (re-tokenizing a reply need not give back the
        tokens the model generated, and the cache holds those)."""
        if not history:
            if self.template:
                return list(self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
            return self.encode(messages[-1]["content"])
        if not self.template:
            return list(history) + self.encode_plain("\n" + messages[-1]["content"])
        full = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        before = self.hf.apply_chat_template(messages[:-1], tokenize=False)
        if not full.startswith(before):  # a template that rewrites earlier turns: render it all again
            return self.prompt_ids(messages)
        return list(history) + self.encode_plain(full[len(before):])


class Stream:
    """Prints the text of generated tokens as it grows (holding back an incomplete UTF-8 character)."""

    def __init__(self, text: Text, eos: set, out=sys.stdout):
        self.text, self.eos, self.out, self.ids, self.shown = text, eos, out, [], ""

    def __call__(self, token: int) -> None:
        if token in self.eos:
            return
        self.ids.append(token)
        now = self.text.decode(self.ids)
        if not now.endswith("\ufffd") and now.startswith(self.shown):
            self.out.write(now[len(self.shown):])
            self.out.flush()
            self.shown = now


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
        from pipeline.constrain import Constraint, tokenizer_for
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
            from pipeline.constrain import Constraint
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
    ap = argparse.ArgumentParser(prog="python -m pipeline.generate", description=__doc__.split("\n")[0])
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
    ap.add_argument("--kv-storage-dtype", choices=sorted(abi.DTYPES), help="runtime-owned cache storage")
    ap.add_argument("--huge-pages", choices=("on", "off"), default="on",
                    help="back the weights XNNPACK packs and the KV cache with 2 MiB pages after the load (Linux >= "
                         "6.1): faster decode (default: on)")
    return ap


def cache_policy(args):
    from pipeline.runtimes.base import CachePolicy
    policy = CachePolicy(capacity=args.kv_max_capacity,
                         windows=[int(w) for w in args.kv_windows.split(",")] if args.kv_windows else None,
                         kv_dtype=abi.DTYPES[args.kv_storage_dtype] if args.kv_storage_dtype else None)
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
        from pipeline.constrain import ConstraintError, grammar_text
        try:
            args.grammar_text = grammar_text(args.json_schema and Path(args.json_schema),
                                             args.grammar and Path(args.grammar))
        except ConstraintError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    speculation = None
    if args.speculate == "ngram":
        from pipeline.speculate import EXACT_ROWS, Speculation
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
        from pipeline.runtimes.native_cache import back_with_huge_pages
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
