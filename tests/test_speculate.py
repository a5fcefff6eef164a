"""Prompt-lookup speculative decoding in python -m pipeline generate (pipeline/generation/speculate.py).

Greedy output equals plain decoding in every cache mode and both runtimes here, with drafts rejected at every depth
(a scripted drafter: the true continuation with every third drafted token wrong), and the cache after the run is the
plain run's: a probe token's logits match (what a stale entry a rollback left behind would change even where a random
tiny model's argmax does not). The rings are wrapped twice (window 16, 23 slots, 56 positions) with verify steps of a
whole chunk; the hybrids' recurrent state is snapshot and restored (the runtime's on XNNPACK, the program's buffers in
the MLX interpreter). Sampling keeps the target distribution: the rule on fixed distributions, and a tiny model's
token pairs against plain sampling's.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from pipeline.generation.runner import Sampler, Session, open_for_generation
from pipeline.runtimes import CachePolicy
from pipeline.generation.speculate import DraftBudget, NgramDrafter, Speculation, accept
from tests.e2e.test_families import build_family
from tests.helpers import build
from tests.test_generate import _cli, _prompt, _stats

# export.logits_mode=auto (the default) is `tail` in the custom mode (4 rows), `selected` in the offgraph mode
LAST = "export.logits_mode=last"


def test_the_drafter_continues_the_longest_latest_match():
    d = NgramDrafter(2, 3)
    d.extend([1, 2, 3, 9, 1, 2, 4, 5, 7, 1, 2])
    assert d.draft(3) == [4, 5, 7]  # (1, 2) last continued with 4, 5, 7 (not the older 3, 9)
    d.extend([3])
    assert d.draft(2) == [9, 1]  # the trigram (1, 2, 3): its one earlier occurrence continues 9, 1
    d = NgramDrafter(2, 2)
    d.extend([5, 6, 5, 6])
    assert d.draft(5) == [5, 6, 5, 6, 5]  # a match near the end is a period
    assert NgramDrafter(2, 4).draft(3) == [] and d.draft(0) == []
    with pytest.raises(ValueError, match="ngram-min"):
        NgramDrafter(3, 2)


def test_the_budget_stops_drafting_when_drafts_fail_and_tries_again_later():
    b = DraftBudget(6)
    assert b.choose() == 6  # nothing measured: the full draft
    for k in range(1, 8):
        b.timed(k, 0.010 * (1 + 0.1 * (k - 1)))
    for _ in range(10):
        b.drafted(4, 4)
    assert b.choose() >= 4
    for _ in range(20):
        b.drafted(b.choose() or 1, 0)
    assert b.choose() == 0  # drafts that fail cost more than they give
    for _ in range(200):
        b.plain_step()
    assert b.choose() > 0  # the rate drifts back up: drafting is tried again


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.0, 0, 0.8)])
def test_the_sampling_rule_keeps_the_target_distribution(temperature, top_k, top_p):
    """Two verify rows, a two-token draft: the first token drawn is distributed as p(row 0), and the second, given
    the first was the drafted one, as p(row 1), whatever the draft (a likely token, an unlikely one)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 12, generator=g) * 2
    sampler = Sampler(temperature, top_k, top_p, seed=1)
    target = [sampler.probs(r) / sampler.probs(r).sum() for r in rows]
    for draft in ([int(rows[0].argmax()), int(rows[1].argmax())], [int(rows[0].argmin()), 3]):
        n, first, second = 20000, Counter(), Counter()
        for _ in range(n):
            a, nxt = accept(rows, draft, sampler)
            tokens = draft[:a] + [nxt]
            first[tokens[0]] += 1
            if tokens[0] == draft[0]:
                second[tokens[1]] += 1
        tv = 0.5 * sum(abs(first[t] / n - float(target[0][t])) for t in range(12))
        assert tv < 0.015, (draft, tv)
        if sum(second.values()) > 2000:
            m = sum(second.values())
            tv2 = 0.5 * sum(abs(second[t] / m - float(target[1][t])) for t in range(12))
            assert tv2 < 0.03, (draft, tv2)


class Scripted:
    """Drafts the true continuation with every third drafted token wrong (offset each step), so verify steps keep
    0, 1, 2, ... of their drafts and every rollback depth happens."""

    def __init__(self, truth: list[int]):
        self.truth, self.n, self.calls = truth, 0, 0

    def extend(self, ids) -> None:
        self.n += len(ids)

    def draft(self, k: int) -> list[int]:
        self.calls += 1
        d = list(self.truth[self.n:self.n + k])
        return [(t + 1) % 50 if (i + self.calls) % 3 == 2 else t for i, t in enumerate(d)]


def _compare(m: dict, ids: list[int], new: int) -> dict:
    """Plain greedy vs speculative greedy (the scripted drafter, the full draft each step): the tokens, then a
    probe token's logits after both runs."""
    plain_session = Session(open_for_generation(Path(m["pte"]), CachePolicy()))
    plain = plain_session.generate(ids, new, Sampler())
    truth = ids + plain["generated_ids"]
    spec_session = Session(open_for_generation(Path(m["pte"]), CachePolicy()),
                           Speculation(draft_max=plain_session.verify_rows - 1, adaptive=False,
                                       drafter=lambda: Scripted(truth)))
    spec = spec_session.generate(ids, new, Sampler())
    assert spec["generated_ids"] == plain["generated_ids"]
    s = spec["speculation"]
    assert s["verify_steps"] > 5 and 0 < s["accepted"] < s["drafted"], s
    assert spec_session.held == plain_session.held
    probe = [session._feed([7]) for session in (plain_session, spec_session)]
    torch.testing.assert_close(probe[1], probe[0], atol=1e-5, rtol=1e-5)
    return spec


@pytest.mark.parametrize("recipe, n, new", [
    ("tiny_llama_xnnpack", 10, 30),      # HF static cache (full logits)
    ("tiny_llama_offgraph", 10, 30),     # runtime-owned flat cache
    ("tiny_gemma3_custom", 26, 30),      # in-graph rings (window 16, 23 slots): 56 positions wrap them twice, in
                                         # whole-chunk verify steps (logits `tail` of the chunk's 8 rows)
    ("tiny_gemma3_offgraph", 26, 30),    # runtime-owned rings
    ("tiny_gemma3_mlx_offgraph", 26, 30),  # the MLX runtime (our interpreter)
])
def test_greedy_speculation_equals_plain_decoding(recipe, n, new):
    mode = {"tiny_llama_xnnpack": ["export.logits_mode=full"],  # static: last or full
            "tiny_gemma3_custom": ["export.tail_rows=8"]}.get(recipe, [])
    m = build(recipe, "verify.enabled=false", *mode)
    _compare(m, _prompt(m, n), new)


@pytest.mark.parametrize("model_type, backend, mode", [
    ("lfm2", "xnnpack", "offgraph"),         # short-conv states, the runtime's (snapshot and restore in C++)
    ("qwen3_next", "xnnpack", "offgraph"),   # Gated DeltaNet states
    ("bamba", "xnnpack", "offgraph"),        # Mamba-2 states
    ("lfm2", "mlx", "custom"),               # states in the program's buffers (the MLX interpreter copies them)
])
def test_greedy_speculation_equals_plain_decoding_on_hybrids(model_type, backend, mode):
    m = build_family(model_type, backend, mode, "fp32", "export.prefill_chunk=8", "verify.enabled=false")
    assert m["status"] == "ok", m.get("error")
    _compare(m, list(range(3, 13)), 30)


def test_a_state_the_runtime_cannot_roll_back_is_refused_before_any_token():
    m = build_family("lfm2", "xnnpack", "custom", "fp32", "export.prefill_chunk=8", "verify.enabled=false")
    with pytest.raises(ValueError, match="--speculate: .*recurrent state inside the program.*cache.mode=offgraph"):
        Session(open_for_generation(Path(m["pte"]), CachePolicy()), Speculation())


def test_sampled_speculation_keeps_the_distribution_of_plain_sampling():
    """Tokens 2 and 3 of 400 sampled runs (top-k 3, so 9 pairs), with and without speculation (the scripted drafter
    over the greedy run: some drafts kept, some not): a chi-square two-sample test on the pairs."""
    m = build("tiny_llama_offgraph", "verify.enabled=false")
    ids = _prompt(m, 10)
    truth = ids + Session(open_for_generation(Path(m["pte"]), CachePolicy())).generate(ids, 8, Sampler())[
        "generated_ids"]
    plain_s = Session(open_for_generation(Path(m["pte"]), CachePolicy()))
    spec_s = Session(open_for_generation(Path(m["pte"]), CachePolicy()),
                     Speculation(draft_max=3, adaptive=False, drafter=lambda: Scripted(truth)))
    runs = 400
    counts = []
    drafted = accepted = 0
    for session in (plain_s, spec_s):
        c = Counter()
        for seed in range(runs):
            session.reset()
            out = session.generate(ids, 4, Sampler(1.0, top_k=3, seed=seed))
            c[tuple(out["generated_ids"][1:3])] += 1
            if "speculation" in out:
                drafted += out["speculation"]["drafted"]
                accepted += out["speculation"]["accepted"]
        counts.append(c)
    assert 0 < accepted < drafted
    from scipy.stats import chi2_contingency
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = [[c[k] for k in keys] for c in counts]
    assert chi2_contingency(table).pvalue > 0.001, table


def test_the_command_speculates_reports_and_refuses_what_it_cannot():
    m = build("tiny_llama_offgraph", "verify.enabled=false")
    r = _cli("--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt", "one two three one two three one two",
             "--max-new-tokens", "24", "--speculate", "ngram", "--compare-plain", "--kv-max-capacity", "64")
    assert r.returncode == 0, r.stderr[-2000:]
    (stats,) = _stats(r.stderr)
    spec = stats["speculation"]
    assert spec["drafted"] > 0 and spec["accepted"] > 0 and spec["identical"] is True, spec
    # the speedup reported is this run's decode rate over the plain run's
    assert spec["speedup"] == pytest.approx(stats["decode_tok_s"] / spec["plain_decode_tok_s"], abs=0.01), (spec, stats)
    assert "[speculate] drafted" in r.stderr
    # a program with the last row's logits only: the reason and the fix, before any token
    last = build("tiny_llama_offgraph", "verify.enabled=false", LAST)
    r = _cli("--pte", last["pte"], "--tokenizer", last["tokenizer"], "--prompt", "x", "--speculate", "ngram")
    assert r.returncode == 1 and "export.logits_mode=tail" in r.stderr and "Traceback" not in r.stderr
    r = _cli("--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt", "x", "--speculate", "ngram",
             "--draft-max", "40")
    assert r.returncode == 1 and "--draft-max 40" in r.stderr and "at most 15 drafts" in r.stderr, r.stderr[-500:]
    r = _cli("--pte", m["pte"], "--tokenizer", m["tokenizer"], "--prompt", "x", "--speculate", "ngram",
             "--ngram-min", "3", "--ngram-max", "2")
    assert r.returncode == 2 and "--ngram-min 3" in r.stderr
