"""The C++ runners on programs with recurrent layers (tiny random hybrids, built by the pipeline):
- llm_runner, in-graph (custom) and off-graph: the [cache] line names each layer's kind, a rewind is refused but to 0
  (the state holds its current position only);
- llm_batched_runner (both cache kinds) on off-graph LFM2, Qwen3.5 and Bamba (Mamba-2) with a prefill chunk of 8, so
  prompts take several chunks and sessions share forwards: its tokens equal llm_runner's and python -m pipeline
  generate's; the prefix cache's snapshot resumes at the position its state holds (the prompt less its last token),
  and an entry whose state is elsewhere is refused with the reason, the prompt prefilled in full."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline.generation.runner import Sampler, Session, open_for_generation
from pipeline.runtimes import CachePolicy
from tests.e2e.test_families import build_family
from tests.native.test_batched_runner import KINDS, batched, tokens
from tests.native.test_custom_native import turns


@pytest.fixture(scope="module", params=["custom", "offgraph"])
def tiny_hybrid(request) -> dict:
    m = build_family("lfm2", "xnnpack", request.param, "fp32")  # verified; C++ tokens == the Python runtime's
    assert m["status"] == "ok", m.get("error")
    return m


def interactive(bins, m, script: str) -> subprocess.CompletedProcess:
    offgraph = ["--kv-max-capacity", "96"] if m["config"]["cache"]["mode"] == "offgraph" else []
    return subprocess.run([str(bins[0]), "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--chat", "0",
                           "--interactive", "--max-new-tokens", "6", "--ignore-eos", *offgraph], input=script,
                          capture_output=True, text=True, errors="replace", timeout=120)


def test_runner_names_the_layers_state(native_bins, tiny_hybrid):
    proc = interactive(native_bins, tiny_hybrid, "hello there\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    assert "4 layers: 2 conv(2x64) + 2 flat" in proc.stderr


def test_undo_is_refused_but_a_reset_starts_over(native_bins, tiny_hybrid):
    proc = interactive(native_bins, tiny_hybrid, "hello there\nand more\n/undo\n/undo 2\nhello there\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    assert "[undo] refused: cannot rewind to" in proc.stderr and "recurrent state holds position" in proc.stderr
    assert "[undo] 2 turn(s) undone; context 0/96" in proc.stderr
    first, _, again = turns(proc)
    assert again["generated_ids"] == first["generated_ids"]  # after the reset, the first turn's state again


def run_runner(bins, m, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([str(bins[0]), "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--chat", "0", "--prompt",
                           "hello there, and more words to fill the context", "--max-new-tokens", "60",
                           "--ignore-eos", *flags], capture_output=True, text=True, errors="replace", timeout=120)


def test_the_kv_flags_size_the_attention_layers_and_the_state_is_the_programs(native_bins, tiny_hybrid):
    """Off-graph: --kv-max-capacity bounds the positions (the run stops at it) and --kv-storage-dtype stores the K/V,
    while the state stays fp32 at its program's size, and the report says both. A flag of the other cache mode, or
    a missing one, gets the error that names it."""
    state = "[cache] recurrent state fp32 | 1.0 KiB per sequence, whatever the depth"  # 2 conv states of 2 x 64
    if tiny_hybrid["config"]["cache"]["mode"] == "offgraph":
        proc = run_runner(native_bins, tiny_hybrid, "--kv-max-capacity", "40", "--kv-storage-dtype", "bf16")
        assert proc.returncode == 0, proc.stderr
        assert "capacity=40" in proc.stderr and "kv_dtype=BFloat16" in proc.stderr
        assert f"{state} (the program's get_state_shapes; --kv-max-capacity" in proc.stderr
        assert "context_full" in proc.stderr or "context full" in proc.stderr
        missing = run_runner(native_bins, tiny_hybrid)
        assert missing.returncode != 0 and "run it with --kv-max-capacity N" in missing.stderr
    else:
        proc = run_runner(native_bins, tiny_hybrid)
        assert proc.returncode == 0, proc.stderr
        assert f"{state} (the program's buffers)" in proc.stderr
        wrong = run_runner(native_bins, tiny_hybrid, "--kv-max-capacity", "96")
        assert wrong.returncode != 0 and "--kv-max-capacity selects the off-graph KV cache" in wrong.stderr


# -- the batched runner ---------------------------------------------------------------------------------------
A = [(i * 37) % 250 + 3 for i in range(30)]  # 4 chunks of 8
PROMPTS = [A, [(i * 11) % 200 + 7 for i in range(13)], A[:20] + [99], [5, 4, 3, 2, 1]]
NEW = 12


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5_text", "bamba"])
def chunked_hybrid(request) -> dict:
    m = build_family(request.param, "xnnpack", "offgraph", "fp32", "export.prefill_chunk=8")
    assert m["status"] == "ok", m.get("error")
    return m


@pytest.fixture(scope="module")
def single(native_bins, chunked_hybrid):
    """Greedy tokens of one llm_runner session per prompt."""
    from pipeline import native

    def run(ids):
        return native.run(chunked_hybrid["pte"], chunked_hybrid["tokenizer"], prompt_ids=ids, max_new_tokens=NEW,
                          extra_args=["--kv-max-capacity", "96", "--ignore-eos"])["generated_ids"]
    return run


def generate(m: dict, ids: list[int]) -> list[int]:
    session = Session(open_for_generation(Path(m["pte"]), CachePolicy()))
    session.eos = set()  # as --ignore-eos
    return session.generate(ids, NEW, Sampler())["generated_ids"]


@pytest.mark.parametrize("kind", KINDS)
def test_batched_sessions_equal_the_runner_and_generate(kind, batched_bins, chunked_hybrid, single):
    proc, gens, engine = batched(batched_bins, chunked_hybrid["pte"], PROMPTS, "--cache-kind", kind,
                                 "--max-new-tokens", NEW, "--ignore-eos")
    assert tokens(gens) == [single(p) for p in PROMPTS] == [generate(chunked_hybrid, p) for p in PROMPTS]
    assert engine["peak_sessions"] == 4 and engine["failed"] == 0
    assert engine["prefill_tokens"] == sum(map(len, PROMPTS))
    layers = {"qwen3_5_text": "4 layers: 3 matrix(4x16x16) + 1 flat", "lfm2": "4 layers: 2 conv(2x64) + 2 flat",
              "bamba": "4 layers: 2 matrix(8x16x16) + 2 flat"}
    assert layers[chunked_hybrid["config"]["model"]["random"]["arch"]] in proc.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_seed_check(kind, batched_bins, chunked_hybrid, single):
    """The seed's check: the same prompt twice for two rounds gives four identical outputs; cached prompt tokens are
    0 in round 0 and prompt - 1 in round 1."""
    _, gens, engine = batched(batched_bins, chunked_hybrid["pte"], [A, A], "--cache-kind", kind, "--max-new-tokens",
                              NEW, "--ignore-eos", "--prefix-cache-entries", 8, "--prompt-rounds", 2)
    assert tokens(gens) == [single(A)] * 4
    assert [g["cached_tokens"] for g in gens] == [0, 0, len(A) - 1, len(A) - 1]
    assert all(p["identical"] for p in engine["parity"])


@pytest.mark.parametrize("kind", KINDS)
def test_a_snapshot_resumes_only_where_its_state_is(kind, batched_bins, chunked_hybrid):
    """A, then A extended (resumes A's snapshot at 29 and replays from there), then A's first 20 (no snapshot holds
    position 19: refused with the reason, prefilled in full), then A again (the extension's entry, at 32, is refused;
    A's own resumes). One session at a time, so each prompt sees the snapshots before it."""
    prompts = [A, A + [5, 6, 7], A[:20], A]
    args = ["--cache-kind", kind, "--max-decode-sequences", 1, "--max-new-tokens", NEW, "--ignore-eos"]
    _, cold, _ = batched(batched_bins, chunked_hybrid["pte"], prompts, *args)
    proc, warm, engine = batched(batched_bins, chunked_hybrid["pte"], prompts, *args, "--prefix-cache-entries", 3)
    assert tokens(warm) == tokens(cold)
    assert [g["cached_tokens"] for g in warm] == [0, 29, 0, 29]
    assert all("the recurrent state holds position" in r for g in warm for r in g["prefix_refusals"])
    assert [len(g["prefix_refusals"]) for g in warm] == [0, 0, 2, 1]
    p = engine["prefix_cache"]
    assert (p["lookups"], p["hits"], p["misses"]) == (4, 2, 2)
