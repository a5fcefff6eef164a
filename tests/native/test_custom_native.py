"""The C++ runner on a `cache=custom` program: the fused llmpipe::cached_attention kernel over the program's own
cache buffers, and the rewind floor its sliding-window rings impose (tiny random Gemma 3, built by the pipeline); K/V
stored in half, int8 or int4 rows, in the program's buffers or (off-graph) the runtime's cache."""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import build


@pytest.fixture(scope="module")
def tiny_custom() -> dict:
    m = build("tiny_gemma3_custom")  # verify included: C++ tokens == Python runtime == eager
    assert m["status"] == "ok"
    return m


def interactive(bins, m, script: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(bins[0]), "--pte", m["pte"], "--tokenizer", m["tokenizer"], "--chat", "0",
                           "--interactive", "--max-new-tokens", "6", "--ignore-eos"], input=script,
                          capture_output=True, text=True, errors="replace", timeout=120)


def turns(proc) -> list[dict]:
    return [json.loads(ln.split(": ", 1)[1]) for ln in proc.stderr.splitlines() if ln.startswith("STATS_JSON: ")]


def test_runner_reports_the_program_rings(native_bins, tiny_custom):
    proc = interactive(native_bins, tiny_custom, "hello there\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    # window 16, chunk 8: rings of 23 slots in two of the three layers
    assert "[cache] in-graph (program-owned) | capacity=64 | 2 ring layers (window 16, 23 slots)" in proc.stderr


def test_undo_below_what_the_rings_hold_is_refused(native_bins, tiny_custom):
    long_turn = "ab " * 12
    proc = interactive(native_bins, tiny_custom, f"hello there\n/undo\nhello there\n{long_turn}\n/undo\n/reset\n"
                                                 "hello there\n/quit\n")
    assert proc.returncode == 0, proc.stderr
    first, again, second, after_reset = turns(proc)
    # within the rings an undo is exact: the same turn again gives the same tokens
    assert again["generated_ids"] == first["generated_ids"]
    assert second["cache_length"] > 23 + 16  # the rings wrapped past the first turn's window
    assert "[undo] refused:" in proc.stderr
    assert "ring caches no longer hold its window" in proc.stderr
    assert after_reset["generated_ids"] == first["generated_ids"]


@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16", "int8", "int4"])
def test_kv_storage_verifies_and_holds_fewer_bytes(kv_dtype):
    """cache.kv_dtype: the program's K/V buffers in half, or int8 / rotated int4 rows with scales (the fused kernel
    converts on write and reads the stored rows, rings wrapped); verify's references hold the same buffers and round the same
    way, so the exact gate still applies: C++ == Python runtime == eager."""
    import torch

    from tests.helpers import stage_path
    m = build("tiny_gemma3_custom", f"cache.kv_dtype={kv_dtype}")
    assert m["status"] == "ok"
    full = build("tiny_gemma3_custom", stages=("download", "wrap"))
    stored = torch.load(stage_path(m, "wrap") / "module.pt", weights_only=False)
    ref = torch.load(stage_path(full, "wrap") / "module.pt", weights_only=False)
    want = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8, "int4": torch.uint8}[kv_dtype]
    assert {b.dtype for n, b in stored.named_buffers() if n.endswith(("k_cache", "v_cache"))} == {want}
    head_dim = ref.model.config.get_text_config().head_dim
    # fp32 rows of D values against half rows, int8 rows (D values and a 4-byte scale per group of 32) or int4 rows
    # (D / 2 bytes and a 2-byte scale per group)
    groups = -(-head_dim // 32)
    per_row = {"fp16": 2 * head_dim, "bf16": 2 * head_dim, "int8": head_dim + 4 * groups,
               "int4": head_dim // 2 + 2 * groups}[kv_dtype]
    assert stored.cache_bytes() * 4 * head_dim == ref.cache_bytes() * per_row
    assert m["verify"]["native"]["token_parity"]


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_offgraph_quantized_storage_passes_the_exact_gate(storage):
    """verify.runtime.kv_storage_dtype=int8 / int4 on an off-graph program: the runtime's cache (the C++ one, in the
    Python runtime and in llm_runner) keeps quantized rows, rings wrapped; the eager reference's Python cache rounds
    them the same way, so the exact gate applies as to a float cache."""
    m = build("tiny_gemma3_offgraph", f"verify.runtime.kv_storage_dtype={storage}")
    assert m["status"] == "ok"
    assert m["verify"]["native"]["token_parity"]
