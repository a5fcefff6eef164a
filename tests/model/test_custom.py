"""The `custom` KV-cache mode: the llmpipe::cached_attention op (in-graph cache, rings for sliding layers),
its wrapper, its export, its C++ kernel, and agreement of the three cache modes. Tiny random models only.
"""
from __future__ import annotations

import pytest
import torch

from pipeline.model.cache_modes import CACHE_MODES, wrap
from pipeline.model.cache_modes import custom as cc
from pipeline.ops import load_native_kernels

from tests.model.test_offgraph import feed, qkv, sdpa_reference, tiny_gemma3, tiny_llama

TOL = 1e-4


def run_steps(q, k, v, steps, slots, window=0, dtype=torch.float32):
    """Feeds [1,H,S,D] tensors through the op in the given step sizes over fresh caches of `slots` slots."""
    kc = torch.zeros(slots, k.shape[1], k.shape[3], dtype=dtype)
    vc = torch.zeros(slots, v.shape[1], v.shape[3], dtype=dtype)
    outs, pos = [], 0
    for T in steps:
        sl = slice(pos, pos + T)
        outs.append(torch.ops.llmpipe.cached_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], kc, vc,
                                                       torch.arange(pos, pos + T), window, q.shape[-1] ** -0.5))
        pos += T
    return torch.cat(outs, 2), kc


# ---------------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [[12], [1] * 12, [5, 4, 3], [4, 1, 1, 6]],
                         ids=["prefill", "decode", "chunked", "mixed"])
def test_op_matches_sdpa_flat(steps):
    q, k, v = qkv(12)
    got, kc = run_steps(q, k, v, steps, slots=16)
    assert (got - sdpa_reference(q, k, v)).abs().max().item() < TOL
    assert torch.equal(kc[:12], k[0].transpose(0, 1))  # written in place, slot-major
    assert not kc[12:].any()


@pytest.mark.parametrize("steps", [[4] * 5, [1] * 20, [3, 4, 1, 4, 4, 4]], ids=["chunks", "decode", "mixed"])
def test_op_matches_sdpa_ring(steps):
    """w=4, chunk 4: a ring of 7 slots, wrapped several times."""
    q, k, v = qkv(20)
    got, kc = run_steps(q, k, v, steps, slots=7, window=4)
    assert (got - sdpa_reference(q, k, v, window=4)).abs().max().item() < TOL
    assert torch.equal(kc[19 % 7], k[0, :, 19])  # the newest position sits at pos % ring


def test_ring_as_long_as_the_context_takes_any_chunk():
    """Capped at the context (window + chunk - 1 > context), the ring never wraps: a full prefill fits."""
    q, k, v = qkv(10)
    got, _ = run_steps(q, k, v, [10], slots=10, window=4)
    assert (got - sdpa_reference(q, k, v, window=4)).abs().max().item() < TOL


def test_op_gqa_value_dim_and_half_storage():
    q, k, v = qkv(9, Hq=6, Hkv=2, D=8, Dv=4)
    got, _ = run_steps(q, k, v, [5, 1, 3], slots=9)
    assert got.shape == (1, 6, 9, 4)
    assert (got - sdpa_reference(q, k, v)).abs().max().item() < TOL
    half, kc = run_steps(q, k, v, [5, 1, 3], slots=9, dtype=torch.float16)
    assert kc.dtype == torch.float16 and (half - got).abs().max().item() < 1e-2


@pytest.mark.parametrize("slots,window,pos,T,msg", [
    (8, 0, 6, 3, r"positions \[6, 9\) exceed the cache's 8 positions"),
    (7, 4, 6, 5, "does not fit a ring of 7 slots with window 4"),
    (7, -1, 0, 1, "negative window"),
])
def test_op_refuses_steps_that_do_not_fit(slots, window, pos, T, msg):
    q, k, v = qkv(T)
    kc, vc = torch.zeros(slots, 2, 16), torch.zeros(slots, 2, 16)
    with pytest.raises(ValueError, match=msg):
        torch.ops.llmpipe.cached_attention(q, k, v, kc, vc, torch.arange(pos, pos + T), window, 0.25)


def test_op_refuses_bad_positions():
    q, k, v = qkv(3)
    kc, vc = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    with pytest.raises(ValueError, match="consecutive"):
        torch.ops.llmpipe.cached_attention(q, k, v, kc, vc, torch.tensor([0, 2, 3]), 0, 0.25)


# ---------------------------------------------------------------------------------------------------
# the wrapper
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,chunk", [(tiny_llama, 8), (tiny_llama, 1), (tiny_gemma3, 8),
                                        (tiny_gemma3, 1), (tiny_gemma3, 16)],
                         ids=["llama-chunk8", "llama-decode", "gemma3-chunk8", "gemma3-decode",
                              "gemma3-chunk16"])
def test_wrapped_model_matches_hf(make, chunk):
    model = make()
    ids = torch.randint(0, 128, (1, 45), generator=torch.Generator().manual_seed(5))  # past window 16
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    w = cc.CustomCacheLM(model, 64, "full", prefill_chunk=chunk)
    assert (feed(w, ids, chunk) - ref).abs().max().item() < TOL
    with torch.no_grad():  # HF attention restored afterwards
        assert torch.allclose(model(ids, use_cache=False).logits, ref)


def test_gemma3_rings_hold_window_plus_chunk_minus_one():
    w = cc.CustomCacheLM(tiny_gemma3(), 64, "last", prefill_chunk=8)
    assert w.slots == [23, 23, 64]  # two sliding layers (window 16), one full layer
    # K and V, 1 KV head x 16 dims x fp32 each
    assert w.cache_bytes() == 2 * (23 + 23 + 64) * 16 * 4


def test_three_cache_modes_agree():
    """static, custom and offgraph wrappers of the same model give the same logits (past the window)."""
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    outs = {}
    for mode in ("static", "custom", "offgraph"):
        w = wrap(tiny_gemma3(), mode, 64, "full", 8)
        outs[mode] = torch.cat([feed(w, ids[:, :33], 8)] +
                               [feed_at(w, ids[:, i:i + 1], i) for i in range(33, 40)], 1)
    assert (outs["custom"] - outs["static"]).abs().max().item() < TOL
    assert (outs["offgraph"] - outs["static"]).abs().max().item() < TOL


@torch.no_grad()
def feed_at(module, piece, start):
    return module(piece, torch.arange(start, start + piece.shape[1]))


def test_export_mutates_one_cache_pair_per_layer():
    w = cc.CustomCacheLM(tiny_gemma3(), 64, "last", prefill_chunk=8)
    T = torch.export.Dim("T", min=1, max=8)
    with torch.no_grad():
        ep = torch.export.export(w, (torch.tensor([[1, 2]]), torch.arange(2)), dynamic_shapes=({1: T}, {0: T}),
                                 strict=True)
    # the pre-dispatch graph calls the mutating op itself; decomposed (as to_edge does) it is functional
    # over buffers that the program then updates in place
    ep = ep.run_decompositions({})
    mutated = sorted(ep.graph_signature.buffers_to_mutate.values())
    assert mutated == sorted(f"model.model.layers.{i}.self_attn.{c}_cache" for i in range(3) for c in "kv")
    calls = [n for n in ep.graph.nodes if "cached_attention" in str(n.target) or
             "cached_attention" in str(n.args[0] if n.args else "")]
    assert len(calls) == 3
    assert not [n for n in ep.graph.nodes if "index_put" in str(n.target) or "index_copy" in str(n.target)]


def test_wrapper_is_registered():
    assert CACHE_MODES["custom"] is cc
    assert isinstance(wrap(tiny_llama(), "custom", 32, "last", 4), cc.CustomCacheLM)


# ---------------------------------------------------------------------------------------------------
# the C++ kernel against the Python op
# ---------------------------------------------------------------------------------------------------
class _Layer(torch.nn.Module):
    def __init__(self, slots, window, dtype):
        super().__init__()
        self.window = window
        self.register_buffer("kc", torch.zeros(slots, 2, 8, dtype=dtype))
        self.register_buffer("vc", torch.zeros(slots, 2, 4, dtype=dtype))

    def forward(self, q, k, v, pos):
        return torch.ops.llmpipe.cached_attention(q, k, v, self.kc, self.vc, pos, self.window, 0.3)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("slots,window", [(40, 0), (8, 5)], ids=["flat", "ring"])
def test_kernel_matches_python_op(dtype, tol, slots, window, tmp_path):
    """The program's own cache buffers, updated in place by the C++ kernel across executes, against the
    Python op (GQA 6/2, Dv != D; the ring of 8 slots with window 5 wraps twice)."""
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from executorch.runtime import Runtime

    from pipeline import native
    if not native.kernels_library_path().exists():
        native.runner_path(build=True)
    T = torch.export.Dim("T", min=1, max=4)
    ex = (torch.zeros(1, 6, 2, 8, dtype=dtype), torch.zeros(1, 2, 2, 8, dtype=dtype),
          torch.zeros(1, 2, 2, 4, dtype=dtype), torch.arange(2))
    with torch.no_grad():
        ep = torch.export.export(_Layer(slots, window, dtype), ex, dynamic_shapes=({2: T}, {2: T}, {2: T}, {0: T}))
    prog = to_edge(ep).to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True))
    (tmp_path / "op.pte").write_bytes(prog.buffer)
    load_native_kernels()
    method = Runtime.get().load_program(str(tmp_path / "op.pte")).load_method("forward")
    ref = _Layer(slots, window, dtype)
    g = torch.Generator().manual_seed(0)
    pos = 0
    for n in [4, 3, 1, 1, 4, 2, 1, 4, 1]:  # 21 positions
        q, k, v = (torch.randn(1, h, n, d, generator=g).to(dtype) for h, d in ((6, 8), (2, 8), (2, 4)))
        positions = torch.arange(pos, pos + n)
        got = method.execute([q, k, v, positions])[0]
        want = ref(q, k, v, positions)
        assert got.dtype == dtype and got.shape == (1, 6, n, 4)
        assert (got.float() - want.float()).abs().max().item() < tol, (dtype, pos)
        pos += n
