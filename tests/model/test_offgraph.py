"""The offgraph KV-cache mode: the llmpipe::update_and_attend op, the runtime cache, the HF wrapper.

Spec: /work/shared/design/offgraph-cache.md sections 2, 3 and 5. Tiny random models only.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.model.cache_modes import CACHE_MODES, wrap
from pipeline.model.cache_modes import offgraph as og
from pipeline.model.kv.layout import LayerSpec, cache_layout
from pipeline.model.kv.runtime_cache import OffgraphCache, OffgraphCacheError, bind, bound

TOL = 1e-4


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def sdpa_reference(q, k, v, window=0):
    """Attention of every query over all keys up to it (full sequence, no cache), q/k/v [1,H,S,*]."""
    Hq, Hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(Hq // Hkv, 1)
    v = v.repeat_interleave(Hq // Hkv, 1)
    S = q.shape[2]
    i = torch.arange(S).unsqueeze(1)
    j = torch.arange(S).unsqueeze(0)
    mask = j <= i
    if window:
        mask &= j > i - window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5)


def run_steps(cache, q, k, v, steps, layer=0):
    """Feeds [1,H,S,D] tensors through the op in the given step sizes; returns the concatenated outputs."""
    outs, pos = [], 0
    scale = q.shape[-1] ** -0.5
    with bound(cache):
        for T in steps:
            sl = slice(pos, pos + T)
            outs.append(og.update_and_attend(q[:, :, sl], k[:, :, sl], v[:, :, sl],
                                             torch.arange(pos, pos + T), layer, scale, torch.float32))
            cache.commit(pos, T)
            pos += T
    return torch.cat(outs, 2)


def qkv(S, Hq=4, Hkv=2, D=16, Dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    Dv = Dv or D
    return (torch.randn(1, Hq, S, D, generator=g), torch.randn(1, Hkv, S, D, generator=g),
            torch.randn(1, Hkv, S, Dv, generator=g))


# ---------------------------------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------------------------------
class TwoLayer(torch.nn.Module):
    def forward(self, q, k, v, position):
        a = torch.ops.llmpipe.update_and_attend(q, k, v, position, 0, 0.25, torch.float32)
        b = torch.ops.llmpipe.update_and_attend(a, k, v, position, 1, 0.25, torch.float32)
        return b


def test_op_graph_is_functional_one_op_per_layer():
    q, k, v = qkv(3)
    T = torch.export.Dim("T", min=1, max=8)
    ep = torch.export.export(TwoLayer(), (q, k, v, torch.arange(3)),
                             dynamic_shapes=({2: T}, {2: T}, {2: T}, {0: T}))
    sig = ep.graph_signature
    assert not sig.buffers and not sig.buffers_to_mutate and not sig.user_inputs_to_mutate
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.llmpipe.update_and_attend.default) == 2


def test_op_fake_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v = torch.empty(1, 4, 5, 16), torch.empty(1, 2, 5, 16), torch.empty(1, 2, 5, 8)
        out = og.update_and_attend(q, k, v, torch.arange(5), 0, 0.25, torch.float16)
    assert out.shape == (1, 4, 5, 8) and out.dtype == torch.float16


@pytest.mark.parametrize("steps", [[12], [1] * 12, [5, 4, 3], [4, 1, 1, 6]],
                         ids=["prefill", "decode", "chunked", "mixed"])
def test_op_matches_sdpa_flat(steps):
    q, k, v = qkv(12)
    cache = OffgraphCache([LayerSpec(2, 16, 16)], capacity=32, max_write=12, initial_capacity=4)
    got = run_steps(cache, q, k, v, steps)
    assert torch.allclose(got, sdpa_reference(q, k, v), atol=TOL)
    assert cache.length == 12


@pytest.mark.parametrize("steps", [[4] * 5, [1] * 20, [3, 4, 1, 4, 4, 4]], ids=["chunks", "decode", "mixed"])
def test_op_matches_sdpa_ring(steps):
    # window 5, chunk 4: a ring of 8 slots wraps several times over 20 positions
    q, k, v = qkv(20, seed=1)
    cache = OffgraphCache([LayerSpec(2, 16, 16, window=5)], capacity=64, max_write=4)
    assert cache.layers[0].ring == 8
    got = run_steps(cache, q, k, v, steps)
    assert torch.allclose(got, sdpa_reference(q, k, v, window=5), atol=TOL)


def test_op_gqa_and_value_dim():
    q, k, v = qkv(9, Hq=6, Hkv=2, D=16, Dv=8, seed=2)
    cache = OffgraphCache([LayerSpec(2, 16, 8)], capacity=16, max_write=9)
    got = run_steps(cache, q, k, v, [4, 1, 4])
    assert got.shape == (1, 6, 9, 8)
    assert torch.allclose(got, sdpa_reference(q, k, v), atol=TOL)


def test_op_mqa():
    q, k, v = qkv(7, Hq=4, Hkv=1, seed=3)
    cache = OffgraphCache([LayerSpec(1, 16, 16)], capacity=16, max_write=7)
    assert torch.allclose(run_steps(cache, q, k, v, [3, 4]), sdpa_reference(q, k, v), atol=TOL)


def test_op_overflow_raises():
    q, k, v = qkv(10)
    cache = OffgraphCache([LayerSpec(2, 16, 16)], capacity=8, max_write=8)
    with pytest.raises(OffgraphCacheError, match="capacity 8"):
        run_steps(cache, q, k, v, [6, 4])
    assert cache.length == 6  # the refused step left no trace


def test_op_without_bound_cache_raises():
    q, k, v = qkv(2)
    bind(None)
    with pytest.raises(OffgraphCacheError, match="no off-graph KV cache is bound"):
        og.update_and_attend(q, k, v, torch.arange(2), 0, 0.25, torch.float32)


def test_op_out_dtype_and_half_storage():
    q, k, v = qkv(6, seed=4)
    cache = OffgraphCache([LayerSpec(2, 16, 16)], capacity=8, max_write=6, dtype=torch.float16)
    with bound(cache):
        out = og.update_and_attend(q.half(), k.half(), v.half(), torch.arange(6), 0, 0.25, torch.float16)
    assert out.dtype == torch.float16
    assert cache.layers[0].k.dtype == torch.float16
    assert torch.allclose(out.float(), sdpa_reference(q, k, v), atol=1e-2)


def test_op_out_overload():
    q, k, v = qkv(3)
    cache = OffgraphCache([LayerSpec(2, 16, 16)], capacity=8, max_write=8)
    out = torch.empty(0)
    with bound(cache):
        torch.ops.llmpipe.update_and_attend.out(q, k, v, torch.arange(3), 0, 0.25, torch.float32, out=out)
    assert out.shape == (1, 4, 3, 16)
    assert torch.allclose(out, sdpa_reference(q, k, v), atol=TOL)


# ---------------------------------------------------------------------------------------------------
# the runtime cache
# ---------------------------------------------------------------------------------------------------
def test_flat_plan():
    c = OffgraphCache([LayerSpec(1, 4, 4)], capacity=100, max_write=8)
    p = c.plan(0, 0, 5)
    assert (p.base, p.end, p.write_runs, p.read_runs) == (0, 5, [(0, 5)], [(0, 5)])
    c.commit(0, 5)
    p = c.plan(0, 5, 1)
    assert (p.base, p.end, p.write_runs, p.read_runs) == (0, 6, [(5, 1)], [(0, 6)])
    with pytest.raises(OffgraphCacheError, match="gap"):
        c.plan(0, 7, 1)


def test_ring_wrap_and_eviction():
    # w=4, max_write 4: ring 7; decode at position 7 writes slot 0 and reads [4..6] + [0], base 4
    c = OffgraphCache([LayerSpec(1, 4, 4, window=4)], capacity=100, max_write=4)
    assert c.layers[0].ring == 7
    c.commit(0, 7)
    p = c.plan(0, 7, 1)
    assert p.write_runs == [(0, 1)]
    assert p.read_runs == [(4, 3), (0, 1)]
    assert p.base == 4 and p.span == 4
    with pytest.raises(OffgraphCacheError, match="max_write 4"):
        c.plan(0, 7, 5)
    # a chunk that wraps: positions 5..8 -> slots 5,6,0,1; reads [2, 9) -> slots 2..6 + 0..1
    c2 = OffgraphCache([LayerSpec(1, 4, 4, window=4)], capacity=100, max_write=4)
    c2.commit(0, 5)
    p = c2.plan(0, 5, 4)
    assert p.write_runs == [(5, 2), (0, 2)] and p.read_runs == [(2, 5), (0, 2)] and p.base == 2


def test_ring_keeps_the_right_values():
    c = OffgraphCache([LayerSpec(1, 1, 1, window=4)], capacity=100, max_write=4)
    for pos in range(11):
        p = c.plan(0, pos, 1)
        val = torch.full((1, 1, 1), float(pos))
        c.write(p, val, val)
        c.commit(pos, 1)
        K, _ = c.gather(p)
        assert K.reshape(-1).tolist() == [float(x) for x in range(max(0, pos - 3), pos + 1)]


def test_mixed_flat_and_ring_share_one_length():
    c = OffgraphCache([LayerSpec(1, 4, 4, window=4), LayerSpec(1, 4, 4)], capacity=50, max_write=4)
    c.commit(0, 4)
    assert c.length == 4
    pr, pf = c.plan(0, 4, 4), c.plan(1, 4, 4)
    assert (pr.base, pr.end) == (1, 8) and (pf.base, pf.end) == (0, 8)
    c.commit(4, 4)
    c.commit(2, 1)  # commit never shrinks
    assert c.length == 8
    assert "2 layers: 1 flat + 1 ring(window 4)" in c.describe()
    assert "[cache] off-graph seq | capacity=50 initial=50 kv_dtype=Float" in c.describe()


def test_capacity_refusal():
    c = OffgraphCache([LayerSpec(1, 4, 4)], capacity=10, max_write=8)
    c.commit(0, 8)
    with pytest.raises(OffgraphCacheError, match=r"\[8, 11\) exceed the cache capacity 10"):
        c.plan(0, 8, 3)
    c.plan(0, 8, 2)


def test_rewind_floors():
    c = OffgraphCache([LayerSpec(1, 4, 4, window=4), LayerSpec(1, 4, 4)], capacity=50, max_write=4)
    c.commit(0, 6)  # ring 7 still holds everything
    c.rewind(2)
    assert c.length == 2
    c.commit(2, 10)  # length 12: the ring holds positions [5, 12)
    assert c.rewind_floor() == 8  # a step at 8 reads [5, 8)
    with pytest.raises(OffgraphCacheError, match="lowest safe target 8"):
        c.rewind(7)
    with pytest.raises(OffgraphCacheError, match="cannot rewind to 13"):
        c.rewind(13)
    c.rewind(8)
    assert c.length == 8
    c.rewind(0)  # a reset is always possible
    assert c.length == 0


def test_flat_only_rewinds_anywhere():
    c = OffgraphCache([LayerSpec(1, 4, 4)], capacity=50, max_write=4)
    c.commit(0, 40)
    c.rewind(1)
    assert c.length == 1


def test_growth_keeps_cells():
    c = OffgraphCache([LayerSpec(1, 2, 2)], capacity=20, max_write=8, initial_capacity=3)
    assert c.layers[0].allocated == 3
    for pos, T in [(0, 3), (3, 1), (4, 5), (9, 8)]:
        p = c.plan(0, pos, T)
        val = torch.arange(pos, pos + T, dtype=torch.float32).reshape(1, T, 1).expand(1, T, 2)
        c.write(p, val, -val)
        c.commit(pos, T)
    assert c.layers[0].allocated == 20  # 3 -> 6 -> 12 -> 20 (clamped to capacity)
    K, V = c.gather(c.plan(0, 17, 1))
    assert K[0, :17, 0].tolist() == [float(i) for i in range(17)]
    assert V[0, :17, 1].tolist() == [-float(i) for i in range(17)]


@pytest.mark.parametrize("initial", [0, -5])
def test_zero_or_negative_initial_capacity_refused(initial):
    with pytest.raises(ValueError, match="initial capacity must be >= 1"):
        OffgraphCache([LayerSpec(1, 4, 4)], capacity=10, max_write=4, initial_capacity=initial)


def test_initial_capacity_clamped_to_capacity():
    c = OffgraphCache([LayerSpec(1, 4, 4)], capacity=10, max_write=4, initial_capacity=512)
    assert c.initial_capacity == 10 and c.layers[0].allocated == 10


# ---------------------------------------------------------------------------------------------------
# wrapped HF models against HF's own uncached forward
# ---------------------------------------------------------------------------------------------------
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                           query_pre_attn_scalar=16, sliding_window=16,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=128)
    return Gemma3ForCausalLM(cfg).eval()


@torch.no_grad()
def feed(module, ids, chunk):
    outs = []
    for s in range(0, ids.shape[1], chunk):
        piece = ids[:, s:s + chunk]
        outs.append(module(piece, torch.arange(s, s + piece.shape[1])))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("make,chunk", [(tiny_llama, 8), (tiny_llama, 1), (tiny_gemma3, 8),
                                        (tiny_gemma3, 1), (tiny_gemma3, 16)],
                         ids=["llama-chunk8", "llama-decode", "gemma3-chunk8", "gemma3-decode",
                              "gemma3-chunk16"])
def test_wrapped_model_matches_hf(make, chunk):
    model = make()
    ids = torch.randint(0, 128, (1, 45), generator=torch.Generator().manual_seed(5))  # past window 16
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    w = og.OffgraphLM(model, 64, "full", prefill_chunk=chunk)
    got = feed(w, ids, chunk)
    assert (got - ref).abs().max().item() < TOL
    assert w.cache.length == 45
    # the model is left as it was (HF attention restored)
    with torch.no_grad():
        assert torch.allclose(model(ids, use_cache=False).logits, ref)


def test_gemma3_layout_and_constant_methods():
    model = tiny_gemma3()
    w = og.OffgraphLM(model, 64, "last", prefill_chunk=8)
    assert [L.ring for L in w.cache.layers] == [23, 23, None]
    consts = og.constant_methods(model.config, 64, 8, og.FLAGS[0])
    assert consts["get_n_caches"] == 3
    assert consts["get_kv_heads"].tolist() == [1, 1, 1]
    assert consts["get_head_dims"].tolist() == [16, 16, 16]
    assert consts["get_windows"].tolist() == [16, 16, 0]
    assert cache_layout(model.config, windows=[0]).specs[0].window == 0


def test_wrapper_rerun_from_zero_and_last_logits():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(6))
    w = og.OffgraphLM(model, 32, "last", prefill_chunk=4)
    a = feed(w, ids, 4)
    b = feed(w, ids, 4)  # starts again at 0: a new sequence
    assert a.shape == (1, 3, 128)  # one row per chunk
    assert torch.allclose(a, b)


def test_wrapper_is_registered():
    assert CACHE_MODES["offgraph"] is og
    w = wrap(tiny_llama(), "offgraph", 32, "last")
    assert isinstance(w, og.OffgraphLM)


def test_wrapped_model_exports_without_cache():
    model = tiny_gemma3()
    w = og.OffgraphLM(model, 64, "last", prefill_chunk=8)
    T = torch.export.Dim("T", min=1, max=8)
    with torch.no_grad():
        ep = torch.export.export(w, (torch.tensor([[1, 2]]), torch.arange(2)), dynamic_shapes=({1: T}, {0: T}),
                                 strict=True)
    sig = ep.graph_signature
    assert not sig.buffers_to_mutate and not sig.user_inputs_to_mutate
    # only the model's own constant buffers (RoPE tables, embed scale): no cache
    own = {"model." + n for n, _ in model.named_buffers()}
    assert set(sig.buffers) <= own and not any("cache" in b for b in sig.buffers), sig.buffers
    ops = [n for n in ep.graph.nodes if n.target == torch.ops.llmpipe.update_and_attend.default]
    assert [n.args[4] for n in ops] == [0, 1, 2]


def test_memory_check_gemma3_1b_geometry():
    # spec 3: 26 layers, 22 ring at 512 + 4 flat, 1 KV head, head dim 256, bf16 (1 KiB per slot per layer),
    # chunk 512: 22 x 1023 KiB + 4 x 512 KiB = 24 MiB
    specs = [LayerSpec(1, 256, 256, 0 if (i + 1) % 6 == 0 else 512) for i in range(26)]
    c = OffgraphCache(specs, capacity=32768, max_write=512, initial_capacity=512, dtype=torch.bfloat16)
    total = sum(L.k.nbytes + L.v.nbytes for L in c.layers)
    assert total == (22 * 1023 + 4 * 512) * 1024
    assert round(total / 2**20) == 24
    assert "26 layers: 4 flat + 22 ring(window 512)" in c.describe()
