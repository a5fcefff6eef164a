"""The attention core's promises, checked by native/build/attention_test (native/tests/attention_test.cpp, no
program): a row group's rows get the same bits wherever the chunk is cut, decode steps and row groups get the same
bits on 1 and 2 threads, and every row is within 1e-5 of attention in double precision (on the values the cache
stores); GQA groups of 3 and 4, full and banded attention, a decode step whose keys split in three, K/V stored as
fp32, fp16, bf16, int8 and rotated int4 rows (groups of 32, the last one short at d40), a head dim that is not a whole number
of vectors. Every ISA path of the kernels this CPU takes
(LLMPIPE_ISA: scalar, avx2, avx512 on x86-64; ARM64's run under qemu in tests/native/test_aarch64.py)."""
from __future__ import annotations

import platform

import pytest

from pipeline import native, ops
from tests.helpers import unit_binary_results

CASES = [f"{case}: {promise}" for case in ("gqa3 full", "gqa4 window 37", "mha full", "gqa3 fp16",
                                          "gqa4 window 37 bf16", "gqa2 d40 fp16", "gqa2 d40", "gqa3 int8",
                                          "gqa2 d40 int8", "gqa4 window 37 int8", "gqa3 int4", "gqa2 d40 int4",
                                          "gqa4 window 37 int4")
         for promise in ("a row group's rows do not depend on where the chunk is cut",
                         "the same bits on 1 and 2 threads", "a verify step's rows equal decode steps'",
                         "within 1e-5 of attention in double precision")]


@pytest.fixture(scope="module")
def results(native_bins) -> dict:
    binary = native.BUILD_DIR / "attention_test"
    if not binary.exists():
        native.build_native(force=True)
    return {path: unit_binary_results(binary, CASES, timeout=120, env={"LLMPIPE_ISA": path}) for path in ops.isa_paths()}


@pytest.mark.parametrize("path", ops.ISA_PATHS[platform.machine()])
@pytest.mark.parametrize("case", CASES)
def test_attention_core(case, path, results):
    assert path in results, f"this CPU has no {path} path: {ops.isa()}"
    assert results[path].get(case, f"{case}: did not run").startswith("ok "), results[path].get(case)


def test_every_case_ran_on_every_path(results):
    assert results and all(sorted(r) == sorted(CASES) for r in results.values())
