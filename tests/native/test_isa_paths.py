"""Every ISA path of our kernels against the Python twins, on this CPU: the kernel-versus-twin tests run again in a
process of their own under LLMPIPE_ISA=<path> for each path but the one the CI tier's own run takes (the best: its
tests cover it). The attention core's C++ promises run on every path in tests/native/test_attention_core.py; ARM64's
paths run under qemu in tests/native/test_aarch64.py.

The tied head's and the experts' sums are exact integers, so their outputs are the twin's bits on every path; the
attention and recurrent cores sum floats in each path's order and are held to the twins' tolerances.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from cores_inputs import check_against_twins, write_inputs
from pipeline import native, ops
from pipeline.paths import ROOT

KERNEL_TESTS = [
    "tests/exporters/test_tied_head.py::test_kernel_matches_its_twin",  # bit for bit (tied_head_int_ref)
    "tests/native/test_experts_kernel.py",                              # bit for bit (experts_ref)
    "tests/native/test_recurrent_kernels.py",                           # gated delta, causal conv
    "tests/model/test_custom_split.py::test_kernels_match_python_ops",    # llmpipe::sdpa / update_cache
    "tests/model/test_custom.py::test_kernel_matches_python_op",        # llmpipe::cached_attention, rings
    "tests/native/test_offgraph_native.py::test_pte_matches_eager_wrapper",  # update_and_attend, off-graph cache
]
PATHS = ops.ISA_PATHS[platform.machine()]


@pytest.mark.parametrize("path", PATHS[:-1])
def test_kernels_equal_their_twins_on_every_path(path):
    assert path in ops.isa_paths(), f"this CPU has no {path} path: {ops.isa()}"
    env = {**os.environ, "LLMPIPE_ISA": path}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "not slow",
                           "--durations=0", *KERNEL_TESTS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def test_every_paths_cores_equal_the_twins(native_bins, tmp_path):
    """native/tests/cores_test.cpp runs every path's cores on the same inputs (the tied head's and the experts' outputs
    equal the scalar path's bit for bit); each path's outputs against the Python twins."""
    inputs, out = tmp_path / "in", tmp_path / "out"
    inputs.mkdir(), out.mkdir()
    t = write_inputs(inputs)
    proc = subprocess.run([str(native.BUILD_DIR / "cores_test"), str(inputs), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert f"paths: {' '.join(ops.isa_paths())}" in proc.stdout, proc.stdout
    for path in ops.isa_paths():
        check_against_twins(t, out, path)


def test_the_path_taken_is_the_one_asked():
    """A forced path is the one the kernels take, and one this CPU or build lacks is refused with the paths."""
    for path in ops.isa_paths():
        out = subprocess.run([sys.executable, "-m", "pipeline", "ops", "--isa"],
                             env={**os.environ, "LLMPIPE_ISA": path}, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.startswith(f"{path} (LLMPIPE_ISA={path}"), out.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "pipeline", "ops", "--isa"], env={**os.environ, "LLMPIPE_ISA": "sse9"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "LLMPIPE_ISA=sse9: not a path" in out.stderr
