"""The attention core's promises, checked by native/build/attention_test (native/tests/attention_test.cpp, no
program): a row group's rows get the same bits wherever the chunk is cut, decode steps and row groups get the same
bits on 1 and 2 threads, and every row is within 1e-5 of attention in double precision; GQA groups of 3 and 4, full
and banded attention, a decode step whose keys split in three."""
from __future__ import annotations

import subprocess

import pytest

from pipeline import native

CASES = [f"{case}: {promise}" for case in ("gqa3 full", "gqa4 window 37", "mha full")
         for promise in ("a row group's rows do not depend on where the chunk is cut",
                         "the same bits on 1 and 2 threads", "within 1e-5 of attention in double precision")]


@pytest.fixture(scope="module")
def results(native_bins) -> dict:
    binary = native.BUILD_DIR / "attention_test"
    if not binary.exists():
        native.build_native(force=True)
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    out = {}
    for line in proc.stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("ok", "FAIL"):
            out[rest.split(": ", 2)[0] + ": " + rest.split(": ", 2)[1]] = line
    assert proc.returncode == (0 if all(v.startswith("ok") for v in out.values()) else 1), proc.stderr
    return out


@pytest.mark.parametrize("case", CASES)
def test_attention_core(case, results):
    assert results.get(case, f"{case}: did not run").startswith("ok "), results.get(case)


def test_every_case_ran(results):
    assert sorted(results) == sorted(CASES)
