"""The attention core's promises, checked by native/build/attention_test (native/tests/attention_test.cpp, no
program): a row group's rows get the same bits wherever the chunk is cut, decode steps and row groups get the same
bits on 1 and 2 threads, and every row is within 1e-5 of attention in double precision (on the values the cache
stores); GQA groups of 3 and 4, full and banded attention, a decode step whose keys split in three, K/V stored as
fp32, fp16 and bf16, a head dim that is not a whole number of vectors."""
from __future__ import annotations

import pytest

from pipeline import native
from tests.helpers import unit_binary_results

CASES = [f"{case}: {promise}" for case in ("gqa3 full", "gqa4 window 37", "mha full", "gqa3 fp16",
                                          "gqa4 window 37 bf16", "gqa2 d40 fp16", "gqa2 d40")
         for promise in ("a row group's rows do not depend on where the chunk is cut",
                         "the same bits on 1 and 2 threads", "a verify step's rows equal decode steps'",
                         "within 1e-5 of attention in double precision")]


@pytest.fixture(scope="module")
def results(native_bins) -> dict:
    binary = native.BUILD_DIR / "attention_test"
    if not binary.exists():
        native.build_native(force=True)
    return unit_binary_results(binary, CASES, timeout=120)


@pytest.mark.parametrize("case", CASES)
def test_attention_core(case, results):
    assert results.get(case, f"{case}: did not run").startswith("ok "), results.get(case)


def test_every_case_ran(results):
    assert sorted(results) == sorted(CASES)
