"""A runner refuses a damaged program with a message: --verify-pte (the SHA-256 against a digest or the
manifest.json beside the .pte; sha256_test checks the hash itself), and the plan checks made before ExecuTorch
follows what its verifier leaves unchecked (native/src/runtime/pte_check.h). The random damage is in test_fuzz.py.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

import pte_layout


def run(binary: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True, errors="replace",
                          timeout=120, stdin=subprocess.DEVNULL)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def program(tiny_programs, tmp_path) -> Path:
    """A copy of a small program, with a lower-stage manifest.json beside it that records it as model.pte."""
    pte = tmp_path / "model.pte"
    shutil.copy(tiny_programs / "tiny_8da4w.pte", pte)
    manifest = {"stage": "lower", "outputs": {"model.pte": {"bytes": pte.stat().st_size, "sha256": sha256(pte)}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return pte


def llm(native_bins, pte: Path, *flags) -> subprocess.CompletedProcess:
    return run(native_bins[0], "--pte", pte, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", *flags)


def test_sha256_matches_the_nist_vectors(native_bins):
    proc = run(Path(native_bins[0]).parent / "sha256_test")
    assert proc.returncode == 0, proc.stdout
    assert "ALL PASS" in proc.stdout and "FAIL" not in proc.stdout.replace("ALL PASS", "")


def test_verify_pte_against_the_manifest_and_a_digest(native_bins, program):
    for flag in ("--verify-pte", "--verify-pte=auto", f"--verify-pte={sha256(program)}",
                 f"--verify-pte={sha256(program).upper()}"):
        proc = llm(native_bins, program, flag)
        assert proc.returncode == 0, (flag, proc.stderr)
        assert f"[verify] {program} sha256 {sha256(program)}" in proc.stderr


def test_verify_pte_refuses_a_changed_file(native_bins, program):
    expected = sha256(program)
    data = bytearray(program.read_bytes())
    data[-1000] ^= 0x01  # a bit of the last weights: the program itself still loads and runs
    program.write_bytes(data)
    assert llm(native_bins, program).returncode == 0  # without the flag nothing notices
    for flag in ("--verify-pte", f"--verify-pte={expected}"):
        proc = llm(native_bins, program, flag)
        assert proc.returncode == 1
        assert f"'{program}' does not match its recorded digest" in proc.stderr
        assert f"expected sha256 {expected}" in proc.stderr and f"actual {sha256(program)}" in proc.stderr
        assert "STATS_JSON" not in proc.stderr


def test_verify_pte_without_a_record(native_bins, program, tmp_path):
    other = tmp_path / "other.pte"  # the manifest records model.pte only
    shutil.copy(program, other)
    proc = llm(native_bins, other, "--verify-pte")
    assert proc.returncode == 1
    assert 'has no record of "other.pte"' in proc.stderr and f"actual {sha256(other)}" in proc.stderr
    (tmp_path / "manifest.json").unlink()
    proc = llm(native_bins, program, "--verify-pte")
    assert proc.returncode == 1 and "no manifest.json beside it" in proc.stderr
    assert str(program) in proc.stderr


def test_verify_pte_usage(native_bins, program):
    proc = llm(native_bins, program, "--verify-pte=abc")
    assert proc.returncode == 2 and "--verify-pte expects 64 hex digits" in proc.stderr
    help_text = run(native_bins[0], "--help").stdout
    assert "--verify-pte[=HEX|auto]" in help_text and "manifest.json" in help_text


def test_batched_runner_verifies_too(batched_bins, og_programs, tmp_path):
    pte = tmp_path / "og.pte"
    shutil.copy(og_programs / "og_llama.pte", pte)
    ok = run(batched_bins[0], "--pte", pte, "--ids", "--max-new-tokens", "2", f"--verify-pte={sha256(pte)}", "1,2")
    assert ok.returncode == 0, ok.stderr
    bad = run(batched_bins[0], "--pte", pte, "--ids", "--max-new-tokens", "2", f"--verify-pte={'0' * 64}", "1,2")
    assert bad.returncode == 1 and "does not match its recorded digest" in bad.stderr
    assert "--verify-pte[=HEX|auto]" in run(batched_bins[0], "--help").stdout


# --- the plan checks: damage ExecuTorch 1.5 would follow into a crash, refused with a message instead

def kernel_call_op_index(data: bytes) -> int:
    """File offset of the op_index of the first KernelCall of method 0 that stores one (an op_index of 0 is
    the default, which FlatBuffers leaves out; program.fbs field numbers)."""
    program = pte_layout.Table.root(data)
    plan = program.element(program.vector(1), 0)
    chain = plan.element(plan.vector(5), 0)
    instructions = chain.vector(2)
    for k in range(instructions[0]):
        instr = chain.element(instructions, k)
        if instr.scalar(0, "<B") == 1 and instr.table(1).field(0) is not None:  # KernelCall
            return instr.table(1).field(0)
    raise AssertionError("no KernelCall")


def first_constant_dim(data: bytes) -> int:
    """File offset of the first dim of the first constant XNNPACK tensor (a weight)."""
    for start, _, _, tensor in pte_layout.xnnpack_values(data):
        dims = tensor.vector(2)
        if tensor.scalar(3, "<I") != 0 and dims and dims[0]:
            return start + dims[1]
    raise AssertionError("no XNNPACK constant")


@pytest.mark.parametrize("damage, needle", [
    ("op_index", "calls operator 30000 of"),  # Method::init forgets the error; execute would call a null kernel
    ("weight_dims", "bytes of constant data"),  # XNNPACK would read past the weight (SIGBUS/SIGSEGV)
])
def test_plan_checks_refuse_what_the_loader_would_follow(damage, needle, native_bins, tiny_programs, tmp_path):
    data = bytearray((tiny_programs / "tiny_8da4w.pte").read_bytes())
    if damage == "op_index":
        pos = kernel_call_op_index(bytes(data))
        data[pos:pos + 4] = (30000).to_bytes(4, "little")
    else:
        pos = first_constant_dim(bytes(data))
        data[pos:pos + 4] = (1 << 20).to_bytes(4, "little")
    pte = tmp_path / "damaged.pte"
    pte.write_bytes(data)
    proc = llm(native_bins, pte)
    assert proc.returncode == 1, proc.stderr
    assert f"'{pte}' is damaged: method 'forward'" in proc.stderr and needle in proc.stderr
