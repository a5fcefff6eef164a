"""The C++ runner on a program with recurrent layers (tiny random LFM2, cache=custom, built by the pipeline): the
[cache] line names each layer's kind, and a rewind is refused but to 0 (the state holds its current position only)."""
from __future__ import annotations

import pytest

from tests.e2e.test_families import build_family
from tests.native.test_custom_native import interactive, turns


@pytest.fixture(scope="module")
def tiny_hybrid() -> dict:
    m = build_family("lfm2", "xnnpack", "custom", "fp32")  # the CI cell's build: verified, C++ tokens == Python's
    assert m["status"] == "ok", m.get("error")
    return m


def test_runner_names_the_layers_state(native_bins, tiny_hybrid):
    proc = interactive(native_bins, tiny_hybrid, "hello there\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    assert "[cache] in-graph (program-owned) | capacity=96 | 4 layers: 2 conv(2x64) + 2 flat" in proc.stderr


def test_undo_is_refused_but_a_reset_starts_over(native_bins, tiny_hybrid):
    proc = interactive(native_bins, tiny_hybrid, "hello there\nand more\n/undo\n/undo 2\nhello there\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    assert "[undo] refused: cannot rewind to" in proc.stderr and "recurrent state holds position" in proc.stderr
    assert "[undo] 2 turn(s) undone; context 0/96" in proc.stderr
    first, _, again = turns(proc)
    assert again["generated_ids"] == first["generated_ids"]  # after the reset, the first turn's state again
