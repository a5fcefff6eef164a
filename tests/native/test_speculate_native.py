"""llm_runner --speculate ngram: the drafter, budget and acceptance rule (native/build/speculate_test), and on built
tiny programs in every cache mode: greedy tokens identical to the plain run (--compare-plain) and to python -m
pipeline generate's speculative run, rings wrapped (window 16, 56 positions), hybrids' state snapshot and restored;
what cannot speculate is refused with the reason before any token. (The random tiny models repeat a token, so their
drafts are mostly kept: rejections at every depth are tests/test_speculate.py's scripted drafter in Python, and the
real default program's in tests/e2e/test_smollm2.py.)"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pipeline import native
from pipeline.abi import KV_DTYPES
from pipeline.model.kv.runtime_cache import DTYPE_LABELS
from pipeline.generation.runner import Sampler, Session, open_for_generation
from pipeline.runtimes import CachePolicy
from pipeline.generation.speculate import Speculation
from tests.e2e.test_families import build_family
from tests.helpers import build

PROMPT = [5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 11, 5, 6]  # repeated n-grams with different continuations


def test_the_drafter_budget_and_acceptance_rule(native_bins):
    binary = Path(native_bins[0]).parent / "speculate_test"
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 15, proc.stdout


def _speculate(m: dict, new: int, *extra: str) -> dict:
    return native.run(m["pte"], None, prompt_ids=PROMPT, max_new_tokens=new,
                      extra_args=[*native.cache_args(m), "--ignore-eos", "--speculate", "ngram", "--compare-plain",
                                  *extra])


@pytest.mark.parametrize("make,extra", [
    (lambda: build("tiny_gemma3_custom", "cache.kv_dtype=int8", "verify.enabled=false"), ()),
    (lambda: build("tiny_gemma3_offgraph", "verify.enabled=false"), ("--kv-storage-dtype", "int8")),
    (lambda: build("tiny_gemma3_custom", "cache.kv_dtype=int4", "verify.enabled=false"), ()),
    (lambda: build("tiny_gemma3_offgraph", "verify.enabled=false"), ("--kv-storage-dtype", "int4")),
    (lambda: build_family("lfm2", "xnnpack", "offgraph", "fp32", "export.prefill_chunk=8", "verify.enabled=false"),
     ("--kv-storage-dtype", "int4")),
], ids=["custom-int8-rings", "offgraph-int8-rings", "custom-int4-rings", "offgraph-int4-rings", "lfm2-offgraph-int4"])
def test_speculation_on_quantized_rows_keeps_the_plain_tokens(native_bins, make, extra):
    """Rollback over int8 / int4 K/V rows, rings wrapped (and a recurrent hybrid's attention layers): the greedy
    tokens of the plain run at the same storage."""
    m = make()
    stats = _speculate(m, min(42, m["config"]["export"]["max_context_len"] - len(PROMPT) - 1), *extra)
    spec = stats["speculation"]
    assert spec["identical"] is True and spec["drafted"] > 0, spec
    if extra:
        assert f"kv_dtype={DTYPE_LABELS[KV_DTYPES[extra[-1]]]}" in stats["cache_report"]


@pytest.mark.parametrize("make", [
    lambda: build("tiny_llama_offgraph", "verify.enabled=false"),
    lambda: build("tiny_gemma3_custom", "verify.enabled=false"),     # rings in the program
    lambda: build("tiny_gemma3_offgraph", "verify.enabled=false"),   # the runtime's rings
    lambda: build_family("lfm2", "xnnpack", "offgraph", "fp32", "export.prefill_chunk=8", "verify.enabled=false"),
    lambda: build_family("qwen3_next", "xnnpack", "offgraph", "fp32", "export.prefill_chunk=8",
                         "verify.enabled=false"),
], ids=["llama-offgraph", "gemma3-custom-rings", "gemma3-offgraph-rings", "lfm2-offgraph", "qwen3_next-offgraph"])
def test_greedy_speculation_keeps_the_plain_tokens(native_bins, make):
    m = make()
    new = min(42, m["config"]["export"]["max_context_len"] - len(PROMPT) - 1)  # gemma3: 56 positions, past the ring
    stats = _speculate(m, new)
    spec = stats["speculation"]
    # the tokens of --compare-plain's run, drafts made and judged (qwen3_next's are all refused: the restore path)
    assert spec["identical"] is True and spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"], spec
    assert spec["acceptance"] == pytest.approx(spec["accepted"] / spec["drafted"]), spec
    assert len(stats["generated_ids"]) == new
    session = Session(open_for_generation(Path(m["pte"]), CachePolicy()), Speculation())
    session.eos = set()  # as the C++ run's --ignore-eos
    python = session.generate(PROMPT, new, Sampler())
    assert python["generated_ids"] == stats["generated_ids"]


def test_what_cannot_speculate_is_refused_before_any_token(native_bins):
    last = build("tiny_llama_offgraph", "verify.enabled=false", "export.logits_mode=last")
    with pytest.raises(native.NativeRunError, match="export.logits_mode=tail"):
        _speculate(last, 8)
    with pytest.raises(native.NativeRunError, match="at most 15 drafts"):
        _speculate(build("tiny_llama_offgraph", "verify.enabled=false"), 8, "--draft-max", "16")
    # a `tail` program (the custom mode's default) returns its last 4 rows: 3 drafts at most
    with pytest.raises(native.NativeRunError, match="forward of at most 4 rows: at most 3 drafts"):
        _speculate(build("tiny_llama_custom", "verify.enabled=false"), 8, "--draft-max", "4")
    hybrid = build_family("lfm2", "xnnpack", "custom", "fp32", "export.prefill_chunk=8", "verify.enabled=false")
    with pytest.raises(native.NativeRunError, match="recurrent state inside the program.*cache.mode=offgraph"):
        _speculate(hybrid, 8)
    bad = subprocess.run([str(native_bins[0]), "--pte", last["pte"], "--prompt-ids", "1,2", "--speculate", "ngram",
                          "--ngram-min", "3", "--ngram-max", "2"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ngram-min 3" in bad.stderr


@pytest.mark.parametrize("kind", ["batched-sequence", "batched-cell"])
@pytest.mark.parametrize("make", [
    lambda: build("tiny_gemma3_offgraph", "verify.enabled=false"),   # rings, wrapped
    lambda: build_family("lfm2", "xnnpack", "offgraph", "fp32", "export.prefill_chunk=8", "verify.enabled=false"),
], ids=["gemma3-rings", "lfm2-states"])
def test_the_batched_runner_speculates_with_each_sessions_tokens(native_bins, make, kind):
    """Three sessions sharing forwards, each verifying its own draft: the greedy tokens of each equal a plain
    single-session run's; a hybrid's states are restored and its kept tokens fed again (the replay step)."""
    m = make()
    prompts = [PROMPT, PROMPT[:9], [9, 8, 7, 6, 9, 8, 7, 5, 9, 8]]
    new = m["config"]["export"]["max_context_len"] - len(PROMPT) - 2
    proc = subprocess.run([str(Path(native_bins[0]).parent / "llm_batched_runner"), "--pte", m["pte"], "--ids",
                           "--quiet", "--cache-kind", kind, "--max-new-tokens", str(new), "--ignore-eos",
                           "--speculate", "ngram", *(",".join(map(str, p)) for p in prompts)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gens = [json.loads(ln.split(": ", 1)[1]) for ln in proc.stderr.splitlines() if ln.startswith("GEN_JSON: ")]
    (engine,) = [json.loads(ln.split(": ", 1)[1]) for ln in proc.stderr.splitlines() if ln.startswith("ENGINE_JSON: ")]
    assert engine["drafted"] > 0 and engine["accepted"] > 0, engine
    assert len(gens) == len(prompts), proc.stderr[-3000:]
    for p, g in zip(prompts, gens):
        plain = native.run(m["pte"], None, prompt_ids=p, max_new_tokens=new,
                           extra_args=[*native.cache_args(m), "--ignore-eos"])
        assert g["generated_ids"] == plain["generated_ids"], p
