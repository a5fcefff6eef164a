"""Tiny Gemma 4 builds (conf/model/tiny_gemma4*.yaml) verified end to end, and the off-graph cache of its
KV-shared layers in llm_runner: one entry per layer that computes K/V, the shared layers reading their source's.

CI tier: one off-graph build (fp32, portable, logits `full` so verify also runs llm_batched_runner): Python runtime ==
eager, C++ runner == Python runtime, batched sessions == single C++ runs. Slow tier: every cache mode x config on
xnnpack and mlx with 4w, as the reference validates Gemma 4.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import build

# fp32 K/V of tiny_gemma4 at capacity 64, chunk 8 (test_gemma4.py has the arithmetic): 3 rings of 23 slots x 16
# dims + 1 flat layer of 64 x 32, K and V; all flat (--kv-windows 0) 3 x 64 x 16 + 64 x 32
SHARED_BYTES, ALL_FLAT_BYTES = 25216, 2 * 4 * (3 * 64 * 16 + 64 * 32)


@pytest.fixture(scope="module")
def tiny_gemma4_offgraph():
    # portable: the cache logic under test is our kernels' (XNNPACK's lowering would triple the build's time);
    # the xnnpack and mlx builds are the slow tier's (tests/e2e/test_gemma4_tiny.py)
    m = build("tiny_gemma4_offgraph", "quantize=none", "backend=portable", "export.logits_mode=full",
              "verify.batched=true")
    assert m["status"] == "ok"
    return m


def run_runner(bins, m, *args):
    proc = subprocess.run([str(bins[0]), "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--chat", "0",
                           "--prompt", "the sea and the sky and the sea and the sky and the sea",
                           "--max-new-tokens", "24", "--ignore-eos", "--kv-max-capacity", "64",
                           "--kv-initial-capacity", "64", *args],
                          capture_output=True, text=True, errors="replace", timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("STATS_JSON: ")]
    return proc, json.loads(line.split(": ", 1)[1])


def test_build_verifies_with_every_runtime(tiny_gemma4_offgraph):
    v = tiny_gemma4_offgraph["verify"]
    assert v["gate"] == "exact" and v["same_quant"]["max_logit_err"] < 1e-3, v
    assert v["native"]["token_parity"] is True  # C++ runner == Python runtime
    assert v["native"]["cache_bytes"] == SHARED_BYTES and "2 shared" in v["native"]["cache_report"]
    assert v["batched"]["parity"] is True and v["batched"]["sessions"] == 5  # llm_batched_runner == C++ runner


def test_shared_layers_read_their_source_entry(native_bins, tiny_gemma4_offgraph):
    proc, s = run_runner(native_bins, tiny_gemma4_offgraph)
    # 4 caches for 6 attention layers: the 2 KV-shared ones hold no entry of their own
    assert "4 layers: 1 flat + 3 ring(window 16), 2 shared" in proc.stderr
    assert s["cache_bytes"] == SHARED_BYTES
    assert s["prompt_tokens"] + 24 > 16 + 8  # past the window: the rings wrapped
    # --kv-windows is a pattern over the caches: all flat, the shared layers still read their source's
    flat, f = run_runner(native_bins, tiny_gemma4_offgraph, "--kv-windows", "0")
    assert "4 layers: 4 flat, 2 shared" in flat.stderr
    assert f["cache_bytes"] == ALL_FLAT_BYTES


@pytest.mark.parametrize("kind", ["batched-sequence", "batched-cell"])
def test_batched_runner_reports_the_shared_layers(tiny_gemma4_offgraph, kind):
    from pipeline import native
    _, engine = native.run_batched(tiny_gemma4_offgraph["pte"], [[5, 6, 7, 8]], max_new_tokens=4,
                                   extra_args=["--cache-kind", kind, "--max-session-tokens", "64"])
    assert "4 layers: 1 flat + 3 ring(window 16), 2 shared" in engine["cache_report"], engine["cache_report"]
