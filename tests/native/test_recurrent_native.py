"""The C++ runners on programs with recurrent layers (tiny random LFM2, built by the pipeline), in-graph (custom) and
off-graph: the [cache] line names each layer's kind, a rewind is refused but to 0 (the state holds its current
position only), and the batched runner refuses an off-graph one (it keeps no state per session yet)."""
from __future__ import annotations

import subprocess

import pytest

from tests.e2e.test_families import build_family
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


def test_the_batched_runner_refuses_a_recurrent_program(native_bins, tiny_hybrid):
    batched = native_bins[0].parent / "llm_batched_runner"
    proc = subprocess.run([str(batched), "--pte", tiny_hybrid["pte"], "--tokenizer", tiny_hybrid["tokenizer"],
                           "hello"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    mode = tiny_hybrid["config"]["cache"]["mode"]
    assert ("has recurrent layers" if mode == "offgraph" else "keeps its KV cache in the graph") in proc.stderr
