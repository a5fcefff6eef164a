"""llm_batched_runner: several sessions over one off-graph program, decode steps sharing forwards, and
the prefix cache (offgraph-cache.md §4).

- prefix_cache_test (C++, no program): the prefix-cache rules and the session caches;
- the tiny off-graph programs (og_programs): every session's greedy tokens equal a single-session run,
  for both cache kinds, with logits 'last' and 'full' (with 'full' the decode rows of several sessions
  share one forward); prefix-cache hits (equal, shorter, extended prompts; a refused snapshot falling
  back; LRU) keep the tokens; a prompt longer than the sliding window against the Python runtime;
- the reference's smoke test on gemma-3-270m (real_model).
"""
from __future__ import annotations

import json
import subprocess

import pytest

import offgraph_tiny_export as ote
from tests.helpers import unit_binary_results
from test_offgraph_native import pte_module, python_greedy

KINDS = ["batched-sequence", "batched-cell"]
P30 = ote.PROMPT_IDS  # 30 tokens: past the sliding window of 16 (rings of 16 + 8 - 1 = 23 slots)
PROMPTS = [P30, P30[:5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 12, 13], P30[:20] + [99]]
N_NEW = 12


def run_batched(bins, *args, timeout=300):
    return subprocess.run([str(bins[0]), *map(str, args)], capture_output=True, text=True, errors="replace",
                          timeout=timeout, stdin=subprocess.DEVNULL)


def reports(proc) -> tuple[list[dict], dict]:
    lines = proc.stderr.splitlines()
    gens = [json.loads(ln.split("GEN_JSON: ", 1)[1]) for ln in lines if ln.startswith("GEN_JSON: ")]
    (engine,) = [json.loads(ln.split("ENGINE_JSON: ", 1)[1]) for ln in lines if ln.startswith("ENGINE_JSON: ")]
    return gens, engine


def ids_arg(ids) -> str:
    return ",".join(map(str, ids))


def batched(bins, pte, prompts, *args, ok=True):
    proc = run_batched(bins, "--pte", pte, "--ids", "--quiet", *args, *map(ids_arg, prompts))
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, *reports(proc)


def tokens(gens) -> list[list[int]]:
    return [g["generated_ids"] for g in gens]


@pytest.fixture(scope="module")
def single(native_bins, og_programs):
    """Greedy tokens of one llm_runner session per (program, prompt, budget), --ignore-eos."""
    memo = {}

    def run(name, prompt, n=N_NEW, *extra):
        key = (name, tuple(prompt), n, extra)
        if key not in memo:
            proc = subprocess.run([str(native_bins[0]), "--pte", str(og_programs / f"{name}.pte"), "--prompt-ids",
                                   ids_arg(prompt), "--max-new-tokens", str(n), "--kv-max-capacity", str(ote.CTX),
                                   "--ignore-eos", "--quiet", *extra], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr
            (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("STATS_JSON: ")]
            memo[key] = json.loads(line.split("STATS_JSON: ", 1)[1])["generated_ids"]
        return memo[key]
    return run


# -- the prefix-cache rules and the session caches (C++) ----------------------------------------------
CASES = ["equal_prompt_replays_the_last_token", "shorter_prompt_replays_its_last_token",
         "extended_prompt_reuses_the_whole_entry", "short_or_unrelated_prompts_miss",
         "longest_match_wins_then_most_recent", "lru_evicts_the_least_recently_used", "same_tokens_replace_the_entry",
         "retention_refusal_falls_back", "zero_entries_is_off", "ring_example_in_both_kinds", "rewind_floors_match",
         "capacity_is_refused", "clone_shares_cells_and_copies_on_write", "sequence_clone_is_independent"]


@pytest.fixture(scope="module")
def unit_results(batched_bins) -> dict:
    return unit_binary_results(batched_bins[1], CASES, timeout=60)


@pytest.mark.parametrize("case", CASES)
def test_prefix_cache_rules(case, unit_results):
    assert unit_results.get(case, f"{case}: did not run").startswith("ok "), unit_results.get(case)


def test_unit_binary_runs_every_case(unit_results):
    assert sorted(unit_results) == sorted(CASES)


# -- sessions against single-session runs ---------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["og_gemma3", "og_gemma3_full", "og_llama_full", "og_gemma3_selected"])
def test_sessions_equal_single_session_runs(name, kind, batched_bins, og_programs, single):
    _, gens, engine = batched(batched_bins, og_programs / f"{name}.pte", PROMPTS, "--cache-kind", kind,
                              "--max-new-tokens", N_NEW, "--ignore-eos")
    assert tokens(gens) == [single(name, p) for p in PROMPTS]
    assert [g["prompt_tokens"] for g in gens] == [len(p) for p in PROMPTS]
    assert all(g["status"] == "ok" and g["cached_tokens"] == 0 and g["ttft_ms"] > 0 for g in gens)
    assert engine["peak_sessions"] == 4 and engine["failed"] == 0 and engine["cache_kind"] == kind
    decode = 4 * (N_NEW - 1)
    assert engine["decode_tokens"] == decode and engine["prefill_tokens"] == sum(map(len, PROMPTS))
    if name.endswith(("_full", "_selected")):  # decode rows of several sessions share forwards
        assert engine["shared_decode_forwards"] and engine["forwards"] < decode
    else:  # logits 'last': one decode row per forward; prompt pieces ride along
        assert not engine["shared_decode_forwards"] and engine["forwards"] >= decode


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("storage,label", [("bf16", "BFloat16"), ("int8", "Int8"), ("int4", "Int4")])
def test_stored_kv_equals_single_session_runs(storage, label, kind, batched_bins, og_programs, single):
    """Cells (and rings) of bf16, int8 or int4 rows: each session's tokens equal a single-session run at the same
    storage."""
    _, gens, engine = batched(batched_bins, og_programs / "og_gemma3_full.pte", PROMPTS, "--cache-kind", kind,
                              "--kv-storage-dtype", storage, "--kv-initial-capacity", 8, "--max-new-tokens", N_NEW,
                              "--ignore-eos")
    assert tokens(gens) == [single("og_gemma3_full", p, N_NEW, "--kv-storage-dtype", storage) for p in PROMPTS]
    assert f"kv_dtype={label}" in engine["cache_report"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("storage,label", [("int8", "Int8"), ("int4", "Int4")])
def test_prefix_snapshots_of_quantized_rows(storage, label, kind, batched_bins, og_programs):
    """Snapshots of int8 / int4 rows (their scales inside them) resume as the cold run computes: equal, shorter and
    extended prompts hit and give the cold tokens."""
    a = P30[:12]
    prompts = [a, a, a[:7], a + [5, 6, 7, 8]]
    args = ["--cache-kind", kind, "--max-decode-sequences", 1, "--max-new-tokens", N_NEW, "--ignore-eos",
            "--kv-storage-dtype", storage]
    _, cold, _ = batched(batched_bins, og_programs / "og_gemma3_full.pte", prompts, *args)
    _, warm, engine = batched(batched_bins, og_programs / "og_gemma3_full.pte", prompts, *args,
                              "--prefix-cache-entries", 4)
    assert [g["cached_tokens"] for g in warm] == [0, 11, 6, 12]
    assert tokens(warm) == tokens(cold)
    assert f"kv_dtype={label}" in engine["cache_report"]


@pytest.mark.parametrize("kind", KINDS)
def test_decode_rows_of_four_sessions_share_one_forward(kind, batched_bins, og_programs):
    """4 prompts of 4 tokens, chunk 8, 8 new tokens each. Step 0 prefills two prompts (8 rows); step 1:
    2 decode rows + the other two prompts' 6 rows; step 2: 3 decode rows + the last 2 prompt rows; then
    4 decode rows per forward. Session s decodes at steps s'..s'+6 (s' = 1, 1, 2, 3): 10 forwards for
    28 decode tokens (the 'last' program needs one forward per decode token)."""
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    _, gens, engine = batched(batched_bins, og_programs / "og_gemma3_full.pte", prompts, "--cache-kind", kind,
                              "--max-new-tokens", 8, "--ignore-eos")
    assert engine["forwards"] == 10 and engine["max_rows"] == 8 and engine["decode_tokens"] == 28
    _, gens_last, last = batched(batched_bins, og_programs / "og_gemma3.pte", prompts, "--cache-kind", kind,
                                 "--max-new-tokens", 8, "--ignore-eos")
    assert last["forwards"] >= 28
    assert tokens(gens) == tokens(gens_last)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["og_gemma3", "og_gemma3_full"])
def test_prompt_longer_than_the_window(name, kind, batched_bins, og_programs):
    """P30 wraps the 23-slot rings; round 1 resumes its snapshot after 29 tokens (the rings still hold
    [7, 30), enough for a step at 29): the Python runtime's greedy tokens every time."""
    ref = python_greedy(pte_module(og_programs, name, capacity=ote.CTX), P30, N_NEW)
    _, gens, engine = batched(batched_bins, og_programs / f"{name}.pte", [P30, P30[:5]], "--cache-kind", kind,
                              "--max-new-tokens", N_NEW, "--ignore-eos", "--prefix-cache-entries", 2,
                              "--prompt-rounds", 2)
    assert [g["generated_ids"] for g in gens if g["prompt"] == 0] == [ref, ref]
    assert [g["cached_tokens"] for g in gens] == [0, 0, 29, 4]
    assert all(p["identical"] for p in engine["parity"])


# -- the prefix cache end to end -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_smoke_tiny(kind, batched_bins, og_programs):
    """The reference's smoke test on the tiny Gemma 3: entries 0 and 2, two rounds, greedy."""
    prompt = P30[:12]
    outs = {}
    for entries in (0, 2):
        proc, gens, engine = batched(batched_bins, og_programs / "og_gemma3.pte", [prompt], "--cache-kind", kind,
                                     "--prefix-cache-entries", entries, "--prompt-rounds", 2, "--max-new-tokens",
                                     N_NEW)
        outs[entries] = tokens(gens)
        assert [g["cached_tokens"] for g in gens] == ([0, 0] if entries == 0 else [0, len(prompt) - 1])
        assert engine["parity"] == [{"prompt": 0, "identical": True, "differences": []}]
        assert "[parity] prompt 0: 2 rounds, identical outputs" in proc.stderr
    assert outs[0][0] == outs[0][1] == outs[2][0] == outs[2][1]


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_hits_for_equal_shorter_and_extended_prompts(kind, batched_bins, og_programs):
    """One session at a time, so each prompt sees the snapshots of the ones before it."""
    a = P30[:12]
    prompts = [a, a, a[:7], a + [5, 6, 7, 8], [100, 101, 102]]
    args = ["--cache-kind", kind, "--max-decode-sequences", 1, "--max-new-tokens", N_NEW, "--ignore-eos"]
    _, cold, _ = batched(batched_bins, og_programs / "og_gemma3_full.pte", prompts, *args)
    _, warm, engine = batched(batched_bins, og_programs / "og_gemma3_full.pte", prompts, *args,
                              "--prefix-cache-entries", 4)
    # equal: len - 1 (the last token is replayed); shorter: its own len - 1; extended: the whole entry
    assert [g["cached_tokens"] for g in warm] == [0, 11, 6, 12, 0]
    assert tokens(warm) == tokens(cold)
    p = engine["prefix_cache"]
    assert (p["lookups"], p["hits"], p["misses"], p["refusals"]) == (5, 3, 2, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_refused_snapshot_falls_back_to_an_older_one(kind, batched_bins, og_programs):
    """Y = P30[:20]; X = P30 (resumes Y after 20 tokens, then wraps the rings: its snapshot resumes no
    lower than 22); Q = P30[:20] + [99] shares 20 with both: X, the newer, is refused, Y is used."""
    prompts = [P30[:20], P30, P30[:20] + [99]]
    args = ["--cache-kind", kind, "--max-decode-sequences", 1, "--max-new-tokens", N_NEW, "--ignore-eos"]
    _, cold, _ = batched(batched_bins, og_programs / "og_gemma3.pte", prompts, *args)
    proc, warm, engine = batched(batched_bins, og_programs / "og_gemma3.pte", prompts, *args,
                                 "--prefix-cache-entries", 3)
    assert [g["cached_tokens"] for g in warm] == [0, 20, 20]
    assert [len(g["prefix_refusals"]) for g in warm] == [0, 0, 1]
    assert "lowest safe target 22" in warm[2]["prefix_refusals"][0]
    assert "[prefix] gen 2 refused a snapshot" in proc.stderr
    assert engine["prefix_cache"]["refusals"] == 1
    assert tokens(warm) == tokens(cold)


def test_lru_evicts_the_least_recently_used_snapshot(batched_bins, og_programs):
    a, b = P30[:10], [100, 101, 102, 103, 104]
    cached = {}
    for entries in (1, 2):
        _, gens, engine = batched(batched_bins, og_programs / "og_gemma3.pte", [a, b, a], "--max-decode-sequences", 1,
                                  "--max-new-tokens", 4, "--prefix-cache-entries", entries)
        cached[entries] = [g["cached_tokens"] for g in gens]
        assert engine["prefix_cache"]["evictions"] == {1: 2, 2: 0}[entries]  # one entry: B evicts A, A evicts B
    assert cached == {1: [0, 0, 0], 2: [0, 0, 9]}


# -- reports, outputs, failures, flags ---------------------------------------------------------------
def test_out_prefix_and_stats_json(batched_bins, og_programs, tmp_path):
    proc, gens, engine = batched(batched_bins, og_programs / "og_gemma3.pte", [P30[:6], P30[:9]],
                                 "--prompt-rounds", 2, "--max-new-tokens", 5, "--out-prefix", tmp_path / "gen",
                                 "--stats-json", tmp_path / "stats.jsonl", "--ignore-eos")
    assert [g["generation"] for g in gens] == [0, 1, 2, 3]
    assert [(g["round"], g["prompt"]) for g in gens] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for g in gens:
        text = (tmp_path / f"gen_{g['generation']}.txt").read_text()
        assert text == " ".join(map(str, g["generated_ids"]))  # no tokenizer: the ids
        assert g["decode_ms_per_token"] > 0 and g["generated_tokens"] == 5
    lines = [json.loads(x) for x in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert lines[:4] == gens and lines[4] == engine
    for key in ("wall_ms", "forwards", "decode_tok_s", "peak_sessions", "rounds", "parity"):
        assert key in engine
    assert engine["decode_tok_s"] > 0 and len(engine["rounds"]) == 2
    assert "[engine] wall" in proc.stderr and "tok/s over all sessions" in proc.stderr


def test_a_failed_generation_exits_1(batched_bins, og_programs):
    proc, gens, engine = batched(batched_bins, og_programs / "og_gemma3.pte", [P30, P30[:5]],
                                 "--max-session-tokens", 20, "--max-new-tokens", 4, ok=False)
    assert proc.returncode == 1
    assert gens[0]["status"] == "error" and "--max-session-tokens" in gens[0]["error"]
    assert gens[1]["status"] == "ok" and len(gens[1]["generated_ids"]) >= 1
    assert engine["failed"] == 1 and "error: 1 of 2 generations failed" in proc.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_context_full(kind, batched_bins, og_programs, single):
    _, (g,), _ = batched(batched_bins, og_programs / "og_gemma3.pte", [P30], "--cache-kind", kind,
                         "--max-session-tokens", 34, "--max-new-tokens", 20, "--ignore-eos")
    assert g["stop_reason"] == "context_full" and g["generated_ids"] == single("og_gemma3", P30, 5)


def test_sampling_is_seeded_per_session(batched_bins, og_programs):
    args = ["--temperature", 0.9, "--top-k", 20, "--seed", 5, "--prompt-rounds", 2, "--max-new-tokens", 10,
            "--ignore-eos"]
    _, first, engine = batched(batched_bins, og_programs / "og_gemma3.pte", [P30[:8], P30[:8]], *args)
    _, again, _ = batched(batched_bins, og_programs / "og_gemma3.pte", [P30[:8], P30[:8]], *args)
    assert tokens(first) == tokens(again)
    assert all(p["identical"] for p in engine["parity"])  # round 1 samples prompt p with seed 5 + p again


def test_reference_spellings_windows_and_default_capacity(batched_bins, og_programs, single):
    """The reference's underscore flags are the dashed ones; --kv-initial-capacity -1 is the default; --kv-windows
    changes the cache policy only (rows per forward stay the exported chunk, 8, over windows of 4) and gives the
    tokens llm_runner gives with the same windows."""
    prompts = [P30, P30[:5]]
    dashed = ["--cache-kind", "batched-cell", "--max-session-tokens", 64, "--max-decode-sequences", 2,
              "--prefix-cache-entries", 2, "--prompt-rounds", 2, "--max-new-tokens", 6, "--kv-windows", "4,0",
              "--kv-initial-capacity", -1, "--ignore-eos"]
    under = ["--" + a[2:].replace("-", "_") if isinstance(a, str) and a.startswith("--") else a for a in dashed]
    under[under.index("--ignore_eos")] = "--ignore-eos"  # both spellings in one command line
    _, g1, e1 = batched(batched_bins, og_programs / "og_gemma3.pte", prompts, *dashed)
    _, g2, e2 = batched(batched_bins, og_programs / "og_gemma3.pte", prompts, *under)
    assert tokens(g1) == tokens(g2) and [g["cached_tokens"] for g in g2] == [0, 0, 29, 4]
    assert e2["chunk"] == 8 and e2["max_rows"] == 8 and e2["max_decode_sequences"] == 2
    assert "2 ring(window 4)" in e2["cache_report"] and "capacity=64 per session initial=64" in e2["cache_report"]
    ref = [single("og_gemma3", p, 6, "--kv-windows", "4,0") for p in prompts]
    assert tokens(g2) == ref * 2


USAGE = [
    (["--cache-kind", "paged"], "--cache-kind expects batched-sequence or batched-cell, got 'paged'"),
    (["--cache_kind", "paged"], "--cache-kind expects batched-sequence or batched-cell, got 'paged'"),
    (["--kv_initial_capacity", "-2"], "or -1 for the default"),
    (["--kv_windows", "4,x"], "--kv-windows expects non-negative integers, got 'x'"),
    (["--kv-storage-dtype", "int2"], "--kv-storage-dtype expects fp32, fp16, bf16, int8 or int4"),
    (["--max-decode-sequences", "0"], "--max-decode-sequences must be >= 1"),
    (["--prefix-cache-entries", "-1"], "--prefix-cache-entries must be >= 0"),
    (["--prompt-rounds", "0"], "--prompt-rounds must be >= 1"),
    (["--max-session-tokens", "97"], "--max-session-tokens 97 exceeds the program's max context 96"),
    (["--kv-initial-capacity", "0"], "--kv-initial-capacity must be >= 1"),
    (["--chat", "nope"], "--chat: unknown chat template 'nope'"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--max-new-tokens", "x"], "--max-new-tokens expects an integer, got 'x'"),
    (["--bogus"], "unknown argument '--bogus'"),
]


@pytest.mark.parametrize("args,msg", USAGE, ids=[a[0] for a, _ in USAGE])
def test_usage_errors_exit_2(args, msg, batched_bins, og_programs):
    proc = run_batched(batched_bins, "--pte", og_programs / "og_gemma3.pte", "--ids", *args, "1,2,3")
    assert proc.returncode == 2 and msg in proc.stderr, proc.stderr


def test_prompts_and_tokenizer_are_required(batched_bins, og_programs):
    proc = run_batched(batched_bins, "--pte", og_programs / "og_gemma3.pte", "--ids")
    assert proc.returncode == 2 and "give at least one prompt" in proc.stderr
    proc = run_batched(batched_bins, "--pte", og_programs / "og_gemma3.pte", "hello")
    assert proc.returncode == 2 and "--tokenizer is required unless --ids" in proc.stderr


def test_in_graph_program_is_refused(batched_bins, tiny_programs):
    proc = run_batched(batched_bins, "--pte", tiny_programs / "tiny_last.pte", "--ids", "1,2,3")
    assert proc.returncode == 1 and "serves off-graph programs" in proc.stderr, proc.stderr


def test_help_lists_every_flag(batched_bins):
    out = run_batched(batched_bins, "--help").stdout
    for flag in ("--max-session-tokens", "--max-decode-sequences", "--cache-kind", "--kv-initial-capacity",
                 "--kv-storage-dtype", "--temperature", "--top-p", "--top-k", "--seed", "--chat",
                 "--prefix-cache-entries", "--prompt-rounds", "--out-prefix", "--stats-json", "--ids", "--kv-windows"):
        assert flag in out
    assert "also takes underscores" in out and "get_chat_template" in out
    assert "batched-sequence (one off-graph cache per session)" in out and "(default: batched-sequence)" in out


# -- the reference's smoke test on the real model ------------------------------------------------------
@pytest.mark.real_model
@pytest.mark.parametrize("kind", KINDS)
def test_gemma3_prefix_cache_smoke(kind, gemma3_offgraph, batched_bins, native_bins):
    """gemma-3-270m off-graph (the shared CI build), prefix entries 0 and 2, two prompt rounds, greedy: the four
    outputs are compared (and must agree, and equal a single-session llm_runner run); the cached run resumes round 1
    after prompt - 1 tokens. (The reference greps "Paris"; this Q4_K_M-derived 270m model echoes the
    question instead, in llm_runner as here, so the check is token parity with the single-session run.)"""
    m, prompt = gemma3_offgraph, "What is the capital of France?"
    single = subprocess.run([str(native_bins[0]), "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--chat", "gemma",
                             "--kv-max-capacity", "1024", "--max-new-tokens", "24", "--quiet", "--prompt", prompt],
                            capture_output=True, text=True, timeout=900)
    assert single.returncode == 0, single.stderr[-3000:]
    (line,) = [ln for ln in single.stderr.splitlines() if ln.startswith("STATS_JSON: ")]
    ref = json.loads(line.split("STATS_JSON: ", 1)[1])
    outs, texts = {}, {}
    for entries in (0, 2):
        proc = run_batched(batched_bins, "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--chat", "gemma",
                           "--cache-kind", kind, "--prefix-cache-entries", entries, "--prompt-rounds", 2,
                           "--max-new-tokens", 24, "--quiet", prompt, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        gens, engine = reports(proc)
        n = gens[0]["prompt_tokens"]
        assert gens[0]["prompt_ids"] == ref["prompt_ids"]
        assert [g["cached_tokens"] for g in gens] == ([0, 0] if entries == 0 else [0, n - 1])
        assert "[parity] prompt 0: 2 rounds, identical outputs" in proc.stderr
        for g in gens:
            outs[(entries, g["round"])] = g["generated_ids"]
            texts[(entries, g["round"])] = g["text"]
        print(f"[{kind}] entries {entries}: parity {engine['parity']} | " +
              " | ".join(f"round {g['round']}: ttft {g['ttft_ms']:.1f} ms, cached {g['cached_tokens']}" for g in gens))
    report = {k: v == ref["generated_ids"] for k, v in outs.items()}
    print(f"[{kind}] four outputs (entries, round) vs llm_runner: {report}; text: {texts[(0, 0)]!r}")
    assert all(report.values()), {k: texts[k] for k in texts}


def test_verify_runs_the_batched_check_when_the_recipe_asks():
    from tests.helpers import build
    m = build("tiny_gemma3_offgraph", "verify.batched=true")
    assert m["status"] == "ok"
    b = m["verify"]["batched"]
    assert b["parity"] and b["sessions"] == len(m["config"]["verify"]["prompts"]) + 1  # and the long prompt
    assert b["equal"] == [True] * b["sessions"]
    assert b["rows_per_forward"] > 1  # the sessions shared forwards


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("kind", KINDS)
def test_gemma3_reference_batched_prefix_check_verbatim(kind, gemma3_offgraph, batched_bins):
    """The reference's batched prefix check with its own (underscore) flags, on gemma-3-270m off-graph: the same
    prompt twice for two rounds gives four identical outputs; cached prompt tokens are 0 in round 0 and
    prompt - 1 in round 1."""
    m, prompt = gemma3_offgraph, "What is the capital of France?"
    proc = run_batched(batched_bins, "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--cache_kind", kind,
                       "--max_session_tokens", 512, "--max_decode_sequences", 4, "--prefix_cache_entries", 8,
                       "--prompt_rounds", 2, "--max_new_tokens", 32, prompt, prompt, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gens, engine = reports(proc)
    n = gens[0]["prompt_tokens"]
    assert [g["cached_tokens"] for g in gens] == [0, 0, n - 1, n - 1]
    assert all(g["generated_ids"] == gens[0]["generated_ids"] for g in gens) and len(gens) == 4
    assert engine["cache_kind"] == kind and all(p["identical"] for p in engine["parity"])


@pytest.mark.real_model
@pytest.mark.parametrize("kind", KINDS)
def test_gemma3_speculation_keeps_single_session_tokens(kind, gemma3_offgraph, batched_bins, native_bins):
    """--speculate ngram in the batched runner on gemma-3-270m off-graph (the shared CI build): a prompt that copies
    its text (drafts kept and rejected) beside a question, sharing forwards; each session's greedy tokens equal a
    plain single-session llm_runner run's."""
    m = gemma3_offgraph
    prompts = ["Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
               "What is the capital of France?"]
    proc = run_batched(batched_bins, "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--chat", "gemma",
                       "--cache-kind", kind, "--max-new-tokens", 40, "--quiet", "--speculate", "ngram", *prompts,
                       timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gens, engine = reports(proc)
    assert 0 < engine["accepted"] < engine["drafted"], engine
    for p, g in zip(prompts, gens):
        single = subprocess.run([str(native_bins[0]), "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--chat",
                                 "gemma", "--kv-max-capacity", "1024", "--max-new-tokens", "40", "--quiet", "--prompt",
                                 p], capture_output=True, text=True, timeout=900)
        (line,) = [ln for ln in single.stderr.splitlines() if ln.startswith("STATS_JSON: ")]
        assert g["generated_ids"] == json.loads(line.split("STATS_JSON: ", 1)[1])["generated_ids"], p
