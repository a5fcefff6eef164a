"""Fidelity to the float model on a fixed corpus, in the form llama.cpp's `llama-perplexity --kl-divergence`
reports: mean, median, 99th percentile and max KL divergence per token, same top-1 %, RMS of delta-p, and the
perplexity of both.

    python bench/fidelity.py                       # our builds and llama.cpp's formats, both models
    python -m pipeline recipe=... verify.fidelity_chunks=4     # the same figures in verify's report

The corpus (bench/corpus/python-reference.txt) is cut into chunks of `n_ctx` tokens; like llama-perplexity, only
the second half of each chunk is scored, so every scored token has at least n_ctx/2 tokens of context. The float
reference is the HF model (the dequantized source) run over each whole chunk; an engine is anything that returns
the logits predicting each scored token: a built program stepped token by token, an eager module, llama.cpp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from pipeline import paths

CORPUS = paths.ROOT / "bench" / "corpus" / "python-reference.txt"


def corpus_chunks(tokenizer, n_ctx: int, n_chunks: int | None = None, corpus: Path = CORPUS) -> list[list[int]]:
    """The corpus as chunks of n_ctx token ids, each opening with BOS when the tokenizer adds one."""
    from pipeline.corpus import chunks_of
    return chunks_of(tokenizer, tokenizer(corpus.read_text(), add_special_tokens=False)["input_ids"], n_ctx, n_chunks,
                     corpus.name)


def scored_range(n_ctx: int) -> tuple[int, int]:
    """Positions whose next token is scored: [first, n_ctx - 1), predicting tokens first+1 .. n_ctx-1."""
    return n_ctx // 2 - 1, n_ctx - 1


@torch.no_grad()
def hf_logits(model, chunk: list[int]) -> torch.Tensor:
    """Logits of every position of a chunk, from one uncached forward of an HF model: [n, V] fp32."""
    return model(input_ids=torch.tensor([chunk]), use_cache=False).logits[0].float()


@torch.no_grad()
def program_logits(program, chunk: list[int], first: int, prefill_chunk: int) -> torch.Tensor:
    """Logits at positions [first, len(chunk) - 1) of a runner-layout callable (a built program or an eager
    wrapper, last-row logits): prefill up to `first` in chunks, then one token per call, as a decode runs."""
    out = []
    logits = None
    for s in range(0, first + 1, prefill_chunk):
        piece = chunk[s:min(s + prefill_chunk, first + 1)]
        logits = program(torch.tensor([piece]), torch.arange(s, s + len(piece)))
    out.append(logits[0, -1].float())
    for pos in range(first + 1, len(chunk) - 1):
        logits = program(torch.tensor([[chunk[pos]]]), torch.tensor([pos]))
        out.append(logits[0, -1].float())
    return torch.stack(out)


@dataclass
class Accumulator:
    """Per-token figures of one engine against the float reference, over all scored tokens."""
    kld: list = field(default_factory=list)
    same_top1: int = 0
    dp_sq: float = 0.0
    nll: float = 0.0
    nll_ref: float = 0.0
    n: int = 0

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        ref_lp = F.log_softmax(ref_logits.float(), -1)
        lp = F.log_softmax(logits.float(), -1)
        kld = (ref_lp.exp() * (ref_lp - lp)).sum(-1).clamp_min(0)  # rounding can make ~0 negative
        self.kld += kld.tolist()
        self.same_top1 += int((ref_lp.argmax(-1) == lp.argmax(-1)).sum())
        p_ref = ref_lp.gather(-1, targets[:, None])[:, 0]
        p = lp.gather(-1, targets[:, None])[:, 0]
        self.dp_sq += float(((p.exp() - p_ref.exp()) ** 2).sum())
        self.nll -= float(p.sum())
        self.nll_ref -= float(p_ref.sum())
        self.n += len(targets)

    def result(self) -> dict:
        k = torch.tensor(self.kld, dtype=torch.float64)
        return {"tokens": self.n, "kld_mean": float(k.mean()), "kld_median": float(k.median()),
                "kld_p99": float(torch.quantile(k, 0.99)), "kld_max": float(k.max()),
                "same_top1": self.same_top1 / self.n, "rms_dp": math.sqrt(self.dp_sq / self.n),
                "ppl": math.exp(self.nll / self.n), "ppl_float": math.exp(self.nll_ref / self.n)}


def score(reference: Callable, engines: dict[str, Callable], chunks: list[list[int]], progress=None) -> dict:
    """`reference(chunk)` -> logits of every position; `engines[name](chunk, first)` -> the logits at
    [first, n - 1). Returns name -> figures. Chunks run outer, so each reference forward is computed once."""
    acc = {name: Accumulator() for name in engines}
    for chunk in (progress(chunks) if progress else chunks):
        first, end = scored_range(len(chunk))
        ref = reference(chunk)[first:end]
        targets = torch.tensor(chunk[first + 1:end + 1])
        for name, engine in engines.items():
            acc[name].add(ref, engine(chunk, first), targets)
    return {name: a.result() for name, a in acc.items()}
