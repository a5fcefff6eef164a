"""The Python runner: a built program opened where verify runs it (pipeline/runtimes: the ExecuTorch runtime, its
runtime-owned cache for off-graph programs, the MLX interpreter, the transformers route's prefill/decode pair), a
session that prefills and decodes it token by token (speculating and constrained where asked), its sampler, and the
text around it (chat template, streaming). `python -m pipeline generate` is its command (pipeline/commands/generate.py).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from pipeline import abi


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
        self.constraint = constraint  # generation/constrain.py: the grammar masks the logits and takes each token

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
