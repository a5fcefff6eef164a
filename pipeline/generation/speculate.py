"""Prompt-lookup speculative decoding (`--speculate ngram`): draft tokens from the context itself, verify them in
one chunked forward, keep the longest prefix the program would have produced, roll the cache back past the rest.

- Drafts: the longest recent n-gram match (NgramDrafter). No draft model: edits, summaries and code quote their
  prompt, so a match's continuation is often what comes next.
- Verify: [pending, d1..dk] at positions [L, L+k], every row's logits (a program with logits mode full or selected).
- Accept: greedy keeps d_i while it is the argmax; sampling keeps d_i with probability p(d_i) and on a rejection draws
  from p with d_i removed (the speculative sampling rule for a draft that is one token for sure), so the tokens keep
  the target distribution p of the plain sampler (temperature, top-k, top-p).
- Rollback: a rewind of the cache to what was kept; a recurrent state cannot step back, so it is restored from a
  snapshot taken before the verify and the kept tokens are fed again.
- K adapts (DraftBudget): the draft length that maximises expected tokens per second, from the acceptance rate and
  the forward times measured in this run, 0 (a plain step) when drafting does not pay.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


# A verify step of up to EXACT_ROWS rows computes each row bit for bit as a decode step would (the attention splits a
# row's keys by its own keys; XNNPACK's GEMMs of up to 4 rows match its 1-row path), so greedy output is
# token-identical to plain decoding; wider steps take other kernels whose rows differ by rounding.
EXACT_ROWS = 4


class NgramDrafter:
    """The continuation of the latest earlier occurrence of the context's last n tokens, n from n_max down to n_min.
    An index per n maps an n-gram to where its latest continuation starts, kept up to date as tokens arrive."""

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"--ngram-min {n_min} / --ngram-max {n_max}: need 1 <= min <= max")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.index: dict[int, dict[tuple, int]] = {n: {} for n in range(n_min, n_max + 1)}

    def extend(self, ids) -> None:
        for t in ids:
            j = len(self.tokens)  # the n-grams ending at j - 1 continue at j
            for n, idx in self.index.items():
                if j >= n:
                    idx[tuple(self.tokens[j - n:j])] = j
            self.tokens.append(int(t))

    def draft(self, k: int) -> list[int]:
        """Up to k tokens. A match close to the end is a period: its continuation repeats (p = len - start)."""
        if k < 1:
            return []
        end = len(self.tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            start = self.index[n].get(tuple(self.tokens[end - n:]))
            if start is not None:
                period = end - start
                return [self.tokens[start + i % period] for i in range(k)]
        return []


@dataclass
class DraftBudget:
    """How many tokens to draft: the k in [0, k_max] with the most expected tokens per second, where a step of k
    drafts yields 1 + a + a^2 + ... + a^k tokens (a: the acceptance rate per drafted token, a moving average) and
    costs the measured time of a forward of k + 1 tokens (a moving average per width; unmeasured widths are
    guessed from the plain step). A run of plain steps lets a drift back up, so drafting is tried again."""
    k_max: int
    rate: float = 0.6
    times: dict = field(default_factory=dict)

    def choose(self) -> int:
        t1 = self.times.get(1)
        if t1 is None:
            return self.k_max  # nothing measured yet: try the full draft
        best, best_k = 1.0 / t1, 0
        for k in range(1, self.k_max + 1):
            tokens = sum(self.rate ** i for i in range(k + 1))
            cost = self.times.get(k + 1, t1 * (1 + 0.1 * k))
            if tokens / cost > best * 1.02:  # a draft must beat a plain step by a margin to be worth its risk
                best, best_k = tokens / cost, k
        return best_k

    def timed(self, width: int, seconds: float) -> None:
        old = self.times.get(width)
        self.times[width] = seconds if old is None else 0.7 * old + 0.3 * seconds

    def drafted(self, k: int, accepted: int) -> None:
        observed = accepted / k
        w = min(0.5, 0.15 * k)
        self.rate = (1 - w) * self.rate + w * observed

    def plain_step(self) -> None:
        self.rate += (0.5 - self.rate) * 0.02 if self.rate < 0.5 else 0.0


def accept(rows: torch.Tensor, draft: list[int], sampler) -> tuple[int, int]:
    """(drafted tokens kept, the token after them) from the verify rows [k + 1, V]: row i scores d_{i+1}. With a
    grammar (sampler.constraint), row i is masked in the grammar's state after d_1..d_i, and every token kept is
    given to it."""
    c = getattr(sampler, "constraint", None)
    if sampler.temperature <= 0 and c is None:
        best = rows.argmax(-1).tolist()
        a = 0
        while a < len(draft) and best[a] == draft[a]:
            a += 1
        return a, best[a]
    for i, d in enumerate(draft):
        row = rows[i] if c is None else c.mask(rows[i])
        if sampler.temperature <= 0:
            token = int(row.argmax())
            if token != d:
                c.consume(token)
                return i, token
        else:
            p = sampler.probs(row)
            p = p / p.sum()
            if float(torch.rand((), generator=sampler.gen)) >= float(p[d]):
                p[d] = 0.0  # the residual max(0, p - q) of a draft q that is d for sure
                token = int(torch.multinomial(p / p.sum(), 1, generator=sampler.gen))
                if c is not None:
                    c.consume(token)
                return i, token
        if c is not None:
            c.consume(d)
    return len(draft), sampler(rows[len(draft)])


def _stats(drafted: int, accepted: int, steps: int) -> dict:
    return {"drafted": drafted, "accepted": accepted, "verify_steps": steps,
            "acceptance": round(accepted / drafted, 3) if drafted else None}


@dataclass
class Speculation:
    """`--speculate ngram` with its flags; `decode` runs a session's decode loop with it."""
    draft_max: int = EXACT_ROWS - 1
    ngram_min: int = 2
    ngram_max: int = 4
    adaptive: bool = True
    drafter: Optional[Callable] = None  # () -> an object with extend(ids) and draft(k); None = NgramDrafter

    def decode(self, session, token: int, max_new: int, sample,
               on_token: Callable[[int], None]) -> tuple[list[int], str, dict]:
        """Decode after `token` (sampled, not yet fed; it counts against max_new) with drafts. Returns (the
        tokens after `token`, the stop reason, the speculation stats)."""
        k_max = min(self.draft_max, session.verify_rows - 1)
        budget = DraftBudget(k_max)
        drafter = self.drafter() if self.drafter else NgramDrafter(self.ngram_min, self.ngram_max)
        drafter.extend(session.held + [token])
        out, emitted, drafted, accepted, steps = [], 1, 0, 0, 0
        constraint = getattr(sample, "constraint", None)
        stop = None
        while stop is None:
            if token in session.eos:
                stop = "eos"
            elif emitted >= max_new:
                stop = "max_new_tokens"
            elif len(session.held) >= session.context:
                stop = "context"
            elif constraint is not None and constraint.done:
                stop = "grammar"
            if stop:
                break
            room = min(max_new - emitted - 1, session.context - len(session.held) - 1)
            k = max(0, min(budget.choose() if self.adaptive else k_max, room))
            draft = drafter.draft(k)
            if constraint is not None:  # checked against the grammar first: a constrained run still speculates
                draft = constraint.valid_prefix(draft)
            t0 = time.perf_counter()
            if draft:
                rows = session.verify([token] + draft)
                a, nxt = accept(rows, draft, sample)
                budget.drafted(len(draft), a)
                drafted, accepted, steps = drafted + len(draft), accepted + a, steps + 1
                new = draft[:a] + [nxt]
            else:
                new = [sample(session._feed([token]))]
                budget.plain_step()
            m = 0  # tokens of `new` emitted: all, or up to a stop token or the budget
            for t in new:
                m += 1
                if t in session.eos or emitted + m >= max_new:
                    break
            if draft:
                session.keep(m)  # the cache keeps [token] + new[:m - 1]; new[m - 1] is the next to feed
            budget.timed(len(draft) + 1, time.perf_counter() - t0)  # a recurrent model's replay included
            for t in new[:m]:
                out.append(t)
                on_token(t)
            emitted += m
            drafter.extend(new[:m])
            token = new[m - 1]
        return out, stop, _stats(drafted, accepted, steps)
