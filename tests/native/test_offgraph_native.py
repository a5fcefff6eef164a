"""Offgraph programs in the ExecuTorch Python runtime (libllmpipe_kernels.so) and in llm_runner.

- the .pte (kernel + C++ cache, loaded with ctypes RTLD_GLOBAL) equals the eager wrapper within 1e-4;
- llm_runner --kv-max-capacity gives the same greedy tokens as the Python runtime, prints the cache
  report, honours --kv-windows / --kv-storage-dtype / --kv-initial-capacity, and refuses mismatches.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

import offgraph_tiny_export as ote

TOL = 1e-4


def pte_module(og_programs, name, **policy):
    from pipeline.runtimes import RUNTIMES, CachePolicy
    from pipeline.runtimes.base import RunnerProgram
    return RunnerProgram(RUNTIMES["executorch"], og_programs / f"{name}.pte", CachePolicy(**policy), kernels=("llmpipe",))


def python_greedy(module, prompt, n_new):
    """Greedy decoding through a (tokens, positions) -> logits module, prefill in steps of module.chunk."""
    chunk = module.chunk
    logits, pos = None, 0
    for i in range(0, len(prompt), chunk):
        part = prompt[i:i + chunk]
        logits = module(torch.tensor([part]), torch.arange(pos, pos + len(part)))
        pos += len(part)
    out = []
    while True:
        tok = int(torch.argmax(logits[0, -1].float()))
        out.append(tok)
        if len(out) == n_new:
            return out
        logits = module(torch.tensor([[tok]]), torch.tensor([pos]))
        pos += 1


def run_runner(bins, *args, timeout=120):
    return subprocess.run([str(bins[0]), *map(str, args)], capture_output=True, text=True, errors="replace",
                          timeout=timeout, stdin=subprocess.DEVNULL)


def stats(proc) -> dict:
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("STATS_JSON: ")]
    return json.loads(line.split("STATS_JSON: ", 1)[1])


def ids_arg(ids):
    return ",".join(map(str, ids))


# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["og_llama", "og_gemma3"])
def test_pte_matches_eager_wrapper(name, og_programs):
    eager = ote.wrapped(name)
    pte = pte_module(og_programs, name)
    assert pte.chunk == ote.CHUNK
    prompt = ote.PROMPT_IDS
    steps = [prompt[i:i + ote.CHUNK] for i in range(0, len(prompt), ote.CHUNK)] + [[7], [99], [3], [64]]
    pos = 0
    with torch.no_grad():
        for part in steps:
            tokens, positions = torch.tensor([part]), torch.arange(pos, pos + len(part))
            a, b = eager(tokens, positions), pte(tokens, positions)
            assert a.shape == b.shape == (1, 1, ote.VOCAB)
            assert (a - b).abs().max().item() < TOL, (name, pos)
            pos += len(part)
    assert pte.cache.length == eager.cache.length == pos > ote.WINDOW
    # a rerun from position 0 is a new sequence in both
    first = torch.tensor([prompt[:4]])
    assert (eager(first, torch.arange(4)) - pte(first, torch.arange(4))).abs().max().item() < TOL


def test_pte_without_bound_cache_fails_cleanly(og_programs):
    from executorch.runtime import Runtime

    from pipeline.ops import load_native_kernels
    lib = load_native_kernels()
    lib.llmpipe_cache_bind(None)
    method = Runtime.get().load_program(str(og_programs / "og_llama.pte")).load_method("forward")
    with pytest.raises(RuntimeError):
        method.execute([torch.tensor([[1, 2]]), torch.arange(2)])
    assert b"no off-graph KV cache is bound" in lib.llmpipe_last_error()


def test_native_cache_policy():
    from pipeline.model.kv.layout import LayerSpec
    from pipeline.model.kv.runtime_cache import OffgraphCacheError
    from pipeline.runtimes.native_cache import NativeOffgraphCache
    c = NativeOffgraphCache([LayerSpec(1, 4, 4, window=4), LayerSpec(1, 4, 4)], capacity=50, max_write=4,
                            initial_capacity=3)
    assert c.allocated(0) == 7 and c.allocated(1) == 3
    assert "2 layers: 1 flat + 1 ring(window 4)" in c.describe()
    c.check_step(0, 4)
    with pytest.raises(OffgraphCacheError, match="max_write 4"):
        c.check_step(0, 5)
    c.commit(0, 4)
    c.commit(4, 4)
    c.commit(8, 4)
    assert c.length == 12
    with pytest.raises(OffgraphCacheError, match="lowest safe target 8"):
        c.rewind(7)
    c.rewind(8)
    with pytest.raises(OffgraphCacheError, match="gap"):
        c.check_step(9, 1)
    flat = NativeOffgraphCache([LayerSpec(1, 4, 4)], capacity=10, max_write=16)
    with pytest.raises(OffgraphCacheError, match=r"\[0, 11\) exceed the KV capacity 10"):
        flat.check_step(0, 11)
    flat.check_step(0, 10)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="initial KV capacity must be >= 1"):
            NativeOffgraphCache([LayerSpec(1, 4, 4)], 10, 4, initial_capacity=bad)


@pytest.mark.parametrize("name", ["og_llama", "og_gemma3"])
def test_runner_greedy_matches_python_runtime(name, native_bins, og_programs):
    ref = python_greedy(pte_module(og_programs, name, capacity=ote.CTX), ote.PROMPT_IDS, ote.N_NEW)
    proc = run_runner(native_bins, "--pte", og_programs / f"{name}.pte", "--prompt-ids", ids_arg(ote.PROMPT_IDS),
                      "--max-new-tokens", ote.N_NEW, "--kv-max-capacity", ote.CTX, "--kv-initial-capacity", 8,
                      "--ignore-eos", "--quiet")
    assert proc.returncode == 0, proc.stderr
    s = stats(proc)
    assert s["generated_ids"] == ref, (s["generated_ids"], ref)
    assert s["cache_kind"] == "off-graph" and s["cache_capacity"] == ote.CTX
    assert s["recipe_hash"] == f"offgraph-{name}"
    assert f"[cache] off-graph seq | capacity={ote.CTX} initial=8 kv_dtype=Float" in proc.stderr
    layers = {"og_llama": "2 layers: 2 flat", "og_gemma3": "3 layers: 1 flat + 2 ring(window 16)"}[name]
    assert layers + "\n" in proc.stderr


def test_runner_windows_pattern_and_bf16_storage(native_bins, og_programs):
    # --kv-windows 4,0 over 3 caches: [4, 0, 4]. Policy only: the prefill chunk stays 8 (rings of 4 + 8 - 1 = 11
    # slots, a prefill step of 8 rows over a window of 4), and the tokens equal the Python runtime's with the same
    # policy, which prefills in steps of 4 (rings of 7); the underscore spellings are the same flags.
    ref = python_greedy(pte_module(og_programs, "og_gemma3", capacity=64, windows=[4, 0],
                                   kv_dtype=torch.bfloat16), ote.PROMPT_IDS, ote.N_NEW)
    proc = run_runner(native_bins, "--pte", og_programs / "og_gemma3.pte", "--prompt_ids",
                      ids_arg(ote.PROMPT_IDS), "--max_new_tokens", ote.N_NEW, "--kv_max_capacity", 64,
                      "--kv_windows", "4,0", "--kv_storage_dtype", "bf16", "--ignore_eos", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "prefill chunk" not in proc.stderr  # no "[cache] prefill chunk 8 -> 4" any more
    assert "[cache] off-graph seq | capacity=64 initial=64 kv_dtype=BFloat16" in proc.stderr
    assert "3 layers: 1 flat + 2 ring(window 4)\n" in proc.stderr
    assert stats(proc)["generated_ids"] == ref


def test_runner_capacity_bounds(native_bins, og_programs):
    pte = og_programs / "og_llama.pte"
    proc = run_runner(native_bins, "--pte", pte, "--prompt-ids", ids_arg(ote.PROMPT_IDS), "--kv-max-capacity", 20)
    assert proc.returncode == 1 and "holds 20" in proc.stderr
    proc = run_runner(native_bins, "--pte", pte, "--prompt-ids", ids_arg(ote.PROMPT_IDS), "--kv-max-capacity", 33,
                      "--max-new-tokens", 40, "--ignore-eos", "--quiet")
    assert proc.returncode == 0, proc.stderr
    s = stats(proc)
    assert s["stop_reason"] == "context_full" and s["cache_length"] == 33


def test_runner_offgraph_program_needs_capacity(native_bins, og_programs):
    proc = run_runner(native_bins, "--pte", og_programs / "og_llama.pte", "--prompt-ids", "1,2,3")
    assert proc.returncode == 1
    assert "keeps its KV cache off-graph" in proc.stderr and "--kv-max-capacity" in proc.stderr


@pytest.mark.parametrize("args,msg", [
    (["--kv-windows", "4,0"], "need --kv-max-capacity"),
    (["--kv-max-capacity", "64", "--kv-initial-capacity", "0"], "--kv-initial-capacity must be >= 1"),
    (["--kv-max-capacity", "64", "--kv-initial-capacity", "-3"], "--kv-initial-capacity must be >= 1"),
    (["--kv-max-capacity", "64", "--kv-storage-dtype", "int2"], "expects fp32, fp16, bf16, int8 or int4"),
    (["--kv-max-capacity", "64", "--kv-windows", "4,x"], "non-negative integers"),
    (["--kv-max-capacity", "-1"], "must be >= 0"),
    (["--kv_max_capacity", "64", "--kv_initial_capacity", "-2"], "or -1 for the default (512, clamped"),
])
def test_runner_kv_flag_usage_errors(args, msg, native_bins, og_programs):
    proc = run_runner(native_bins, "--pte", og_programs / "og_llama.pte", "--prompt-ids", "1,2", *args)
    assert proc.returncode == 2 and msg in proc.stderr, proc.stderr


def test_in_graph_program_refuses_kv_capacity(native_bins, tiny_programs):
    proc = run_runner(native_bins, "--pte", tiny_programs / "tiny_last.pte", "--prompt-ids", "1,2",
                      "--kv-max-capacity", 64)
    assert proc.returncode == 1 and "keeps its cache in the graph" in proc.stderr


def test_help_lists_kv_flags(native_bins):
    out = run_runner(native_bins, "--help").stdout
    for flag in ("--kv-max-capacity", "--kv-initial-capacity", "--kv-storage-dtype", "--kv-windows"):
        assert flag in out
    assert "(default: 512)" in out and "-1 = the default" in out and "also takes underscores" in out


def test_runner_initial_capacity_minus_one_is_the_default(native_bins, og_programs):
    """The reference's default spelling: -1 = 512, clamped to the capacity (64 here)."""
    proc = run_runner(native_bins, "--pte", og_programs / "og_llama.pte", "--prompt-ids", "1,2,3", "--max-new-tokens",
                      2, "--kv-max-capacity", 64, "--kv-initial-capacity", -1, "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "[cache] off-graph seq | capacity=64 initial=64 kv_dtype=Float" in proc.stderr


class _OneOp(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, q, k, v, pos):
        return torch.ops.llmpipe.update_and_attend(q, k, v, pos, 1, 0.3, self.dtype)


@pytest.mark.parametrize("dtype,storage,tol", [(torch.float32, None, TOL), (torch.float16, None, 1e-3),
                                               (torch.bfloat16, None, 1e-2), (torch.float32, torch.int8, 1e-4),
                                               (torch.bfloat16, torch.int8, 1e-2), (torch.float32, torch.uint8, 1e-4),
                                               (torch.bfloat16, torch.uint8, 1e-2)],
                         ids=["fp32", "fp16", "bf16", "fp32-int8kv", "bf16-int8kv", "fp32-int4kv", "bf16-int4kv"])
def test_kernel_matches_python_op(dtype, storage, tol, tmp_path, native_bins):
    """The C++ kernel against the Python reference on a ring (w=5, chunk 4, wraps) next to a flat
    layer, with GQA 6/2 and Dv != D, in each activation dtype, K/V stored in it or as int8 / rotated int4 rows (the
    same rounding on both sides: the references' quantized values and scales are the kernel's; one int4 value off by
    a step would move an output by ~0.1, a thousand times the fp32 tolerance)."""
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    from pipeline.model.cache_modes import offgraph as og
    from pipeline.model.kv.layout import LayerSpec
    from pipeline.model.kv.runtime_cache import OffgraphCache
    from pipeline.ops import load_native_kernels
    from pipeline.runtimes.native_cache import NativeOffgraphCache
    T = torch.export.Dim("T", min=1, max=4)
    ex = (torch.zeros(1, 6, 2, 8, dtype=dtype), torch.zeros(1, 2, 2, 8, dtype=dtype),
          torch.zeros(1, 2, 2, 4, dtype=dtype), torch.arange(2))
    ep = torch.export.export(_OneOp(dtype), ex, dynamic_shapes=({2: T}, {2: T}, {2: T}, {0: T}))
    (tmp_path / "op.pte").write_bytes(to_edge(ep).to_executorch().buffer)
    load_native_kernels()
    method = Runtime.get().load_program(str(tmp_path / "op.pte")).load_method("forward")
    specs = [LayerSpec(2, 8, 4, 0), LayerSpec(2, 8, 4, 5)]  # cache_id 1 = the ring
    native = NativeOffgraphCache(specs, capacity=40, max_write=4, initial_capacity=2, dtype=storage or dtype)
    ref = OffgraphCache(specs, capacity=40, max_write=4, initial_capacity=2, dtype=storage or dtype)
    g = torch.Generator().manual_seed(0)
    pos = 0
    for n in [4, 3, 1, 1, 4, 2, 1, 4, 1]:  # 21 positions: the 8-slot ring wraps twice
        q, k, v = (torch.randn(1, h, n, d, generator=g).to(dtype) for h, d in ((6, 8), (2, 8), (2, 4)))
        positions = torch.arange(pos, pos + n)
        native.check_step(pos, n)
        with native.bound():
            got = method.execute([q, k, v, positions])[0]
        native.commit(pos, n)
        with ref.bound():
            want = og.update_and_attend(q, k, v, positions, 1, 0.3, dtype)
        ref.commit(pos, n)
        assert got.dtype == dtype and got.shape == (1, 6, n, 4)
        assert (got.float() - want.float()).abs().max().item() < tol, (dtype, pos)
        pos += n


@pytest.mark.parametrize("dtype,slot_bytes", [("fp32", 2 * 16 * 4), ("bf16", 2 * 16 * 2), ("int8", 2 * (16 + 4)),
                                              ("int4", 2 * (8 + 2))])
def test_runner_ring_memory_equals_formula(dtype, slot_bytes, native_bins, og_programs):
    """og_gemma3: 2 ring layers hold window 16 + chunk 8 - 1 = 23 slots each, the flat layer grows
    from 8 by doubling to cover the sequence; 1 KV head, K and V of 16 dims each (an int8 row: 16 values and one
    group's 4-byte scale; an int4 row: 8 bytes of values and a 2-byte scale)."""
    proc = run_runner(native_bins, "--pte", og_programs / "og_gemma3.pte", "--prompt-ids", ids_arg(ote.PROMPT_IDS),
                      "--max-new-tokens", ote.N_NEW, "--kv-max-capacity", ote.CTX, "--kv-initial-capacity", 8,
                      "--kv-storage-dtype", dtype, "--ignore-eos", "--quiet")
    assert proc.returncode == 0, proc.stderr
    s = stats(proc)
    assert len(s["generated_ids"]) == ote.N_NEW  # --ignore-eos: the whole budget
    flat = 8
    while flat < s["cache_length"]:
        flat *= 2
    assert s["cache_length"] > 2 * ote.WINDOW and flat == 64  # the rings wrapped, the pool doubled 3 times
    assert s["cache_bytes"] == (2 * (ote.WINDOW + ote.CHUNK - 1) + min(flat, ote.CTX)) * 1 * slot_bytes
    assert f"K/V storage {s['cache_bytes'] / 1024:.1f} KiB" in proc.stderr
    assert s["cache_report"].startswith(f"[cache] off-graph seq | capacity={ote.CTX} initial=8")


def test_runner_all_flat_matches_eager_within_the_window(native_bins, og_programs):
    """--kv-windows 0 makes every layer flat (full attention): within the sliding window that is the
    same model, so the tokens equal the eager wrapper's; past it they may not (and that is right)."""
    prompt, n_new = ote.PROMPT_IDS[:8], ote.WINDOW - 8  # the whole sequence stays inside the window
    eager = ote.wrapped("og_gemma3")
    ref = python_greedy(_Chunked(eager, ote.CHUNK), prompt, n_new)
    proc = run_runner(native_bins, "--pte", og_programs / "og_gemma3.pte", "--prompt-ids", ids_arg(prompt),
                      "--max-new-tokens", n_new, "--kv-max-capacity", ote.CTX, "--kv-windows", "0",
                      "--ignore-eos", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "3 layers: 3 flat\n" in proc.stderr
    assert stats(proc)["generated_ids"] == ref


class _Chunked:
    def __init__(self, module, chunk):
        self.module, self.chunk = module, chunk

    def __call__(self, tokens, positions):
        with torch.no_grad():
            return self.module(tokens, positions)
