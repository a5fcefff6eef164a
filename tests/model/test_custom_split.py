"""cache=custom with one flag: llmpipe::sdpa over HF's own static cache (custom_sdpa alone) and llmpipe::update_cache
with the standard attention math (custom_kv_cache alone). The ops against SDPA, the wrappers against HF, the exported
graphs, the C++ kernels against the Python ops, and the rules preflight applies. Tiny random models only."""
from __future__ import annotations

import pytest
import torch

from pipeline.model.cache_modes import custom_split
from pipeline.model.cache_modes import CACHE_MODES, wrap
from pipeline.model.cache_modes import custom as cc
from pipeline.ops import load_native_kernels
from tests.helpers import compose_cfg
from tests.model.test_offgraph import feed, qkv, sdpa_reference, tiny_gemma3, tiny_llama

TOL = 1e-4
SDPA_ONLY = {"custom_sdpa": True, "custom_kv_cache": False}
KV_ONLY = {"custom_sdpa": False, "custom_kv_cache": True}
BOTH = {"custom_sdpa": True, "custom_kv_cache": True}


def run_steps(q, k, v, steps, slots, window=0):
    """update_cache then sdpa, step by step, over fresh BHSD caches of `slots` positions."""
    kc = torch.zeros(1, k.shape[1], slots, k.shape[3])
    vc = torch.zeros(1, v.shape[1], slots, v.shape[3])
    outs, pos = [], 0
    for T in steps:
        sl, p = slice(pos, pos + T), torch.arange(pos, pos + T)
        torch.ops.llmpipe.update_cache(k[:, :, sl], v[:, :, sl], kc, vc, p)
        outs.append(torch.ops.llmpipe.sdpa(q[:, :, sl], kc, vc, p, window, q.shape[-1] ** -0.5))
        pos += T
    return torch.cat(outs, 2), kc


@pytest.mark.parametrize("window", [0, 5], ids=["flat", "window5"])
@pytest.mark.parametrize("steps", [[12], [1] * 12, [5, 4, 3]], ids=["prefill", "decode", "chunked"])
def test_ops_match_sdpa(steps, window):
    q, k, v = qkv(12, Hq=6, Hkv=2, D=16, Dv=8)  # GQA 3, Dv != D
    got, kc = run_steps(q, k, v, steps, slots=16, window=window)
    assert (got - sdpa_reference(q, k, v, window)).abs().max().item() < TOL
    assert torch.equal(kc[0, :, :12], k[0]) and not kc[0, :, 12:].any()  # written in place, BHSD


def test_ops_refuse_bad_steps():
    q, k, v = qkv(4)
    kc, vc = torch.zeros(1, 2, 6, 16), torch.zeros(1, 2, 6, 16)
    with pytest.raises(ValueError, match=r"positions \[4, 8\) exceed the cache's 6 positions"):
        torch.ops.llmpipe.update_cache(k, v, kc, vc, torch.arange(4, 8))
    with pytest.raises(ValueError, match="consecutive"):
        torch.ops.llmpipe.sdpa(q, kc, vc, torch.tensor([0, 1, 3, 4]), 0, 0.25)
    with pytest.raises(ValueError, match=r"k_cache must be \[1, 2, S, 16\]"):
        torch.ops.llmpipe.update_cache(k, v, torch.zeros(6, 2, 16), vc, torch.arange(4))


@pytest.mark.parametrize("flags", [SDPA_ONLY, KV_ONLY], ids=["sdpa", "kv"])
@pytest.mark.parametrize("make,chunk", [(tiny_llama, 8), (tiny_llama, 1), (tiny_gemma3, 8), (tiny_gemma3, 1)],
                         ids=["llama-chunk8", "llama-decode", "gemma3-chunk8", "gemma3-decode"])
def test_wrapped_model_matches_hf(make, chunk, flags):
    model = make()
    ids = torch.randint(0, 128, (1, 45), generator=torch.Generator().manual_seed(5))  # past window 16
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    w = wrap(model, "custom", 64, "full", chunk, flags)
    assert (feed(w, ids, chunk) - ref).abs().max().item() < TOL
    w.reset()  # a reset wrapper starts over
    assert (feed(w, ids[:, :9], chunk) - ref[:, :9]).abs().max().item() < TOL
    with torch.no_grad():  # HF attention restored afterwards
        assert torch.allclose(model(ids, use_cache=False).logits, ref)


def test_the_three_custom_combinations_and_static_agree():
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    outs = {}
    for name, mode, flags in (("static", "static", None), ("both", "custom", BOTH), ("sdpa", "custom", SDPA_ONLY),
                              ("kv", "custom", KV_ONLY)):
        w = wrap(tiny_gemma3(), mode, 64, "full", 8, flags)
        outs[name] = torch.cat([feed(w, ids[:, :33], 8)] + [_at(w, ids[:, i:i + 1], i) for i in range(33, 40)], 1)
    for name in ("both", "sdpa", "kv"):
        assert (outs[name] - outs["static"]).abs().max().item() < TOL, name


@torch.no_grad()
def _at(module, piece, start):
    return module(piece, torch.arange(start, start + piece.shape[1]))


def _export(w):
    T = torch.export.Dim("T", min=1, max=8)
    with torch.no_grad():
        ep = torch.export.export(w, (torch.tensor([[1, 2]]), torch.arange(2)), dynamic_shapes=({1: T}, {0: T}),
                                 strict=True)
    return ep.run_decompositions({})


def _calls(ep, name):
    return [n for n in ep.graph.nodes if name in str(n.target) or name in str(n.args[0] if n.args else "")]


def test_sdpa_alone_reads_the_cache_hf_writes():
    ep = _export(wrap(tiny_gemma3(), "custom", 64, "last", 8, SDPA_ONLY))
    mutated = sorted(ep.graph_signature.buffers_to_mutate.values())
    assert [b for b in mutated if b.startswith(("k_cache_", "v_cache_"))] == sorted(
        f"{c}_cache_{i}" for i in range(3) for c in "kv")
    assert [n for n in ep.graph.nodes if "index_put" in str(n.target) or "index_copy" in str(n.target)]
    assert len(_calls(ep, "llmpipe.sdpa")) == 3
    assert not _calls(ep, "update_cache") and not _calls(ep, "cached_attention")


def test_kv_cache_alone_updates_with_the_op_and_attends_in_the_graph():
    ep = _export(wrap(tiny_gemma3(), "custom", 64, "last", 8, KV_ONLY))
    mutated = sorted(ep.graph_signature.buffers_to_mutate.values())
    assert mutated == sorted(f"model.model.layers.{i}.self_attn.kv_{c}_cache" for i in range(3) for c in "kv")
    assert len(_calls(ep, "update_cache")) == 3
    assert not _calls(ep, "llmpipe.sdpa") and not _calls(ep, "cached_attention")
    assert not [n for n in ep.graph.nodes if "index_put" in str(n.target) or "index_copy" in str(n.target)]
    assert [n for n in ep.graph.nodes if "softmax" in str(n.target)]


def test_only_the_fused_op_keeps_rings():
    cfg = tiny_gemma3().config
    assert cc.rings(BOTH) and not cc.rings(SDPA_ONLY) and not cc.rings(KV_ONLY)
    assert set(cc.constant_methods(cfg, 64, 8, BOTH)) == {"get_ring_windows", "get_ring_slots"}
    assert cc.constant_methods(cfg, 64, 8, SDPA_ONLY) == {} == cc.constant_methods(cfg, 64, 8, KV_ONLY)
    assert isinstance(wrap(tiny_llama(), "custom", 32, "last", 4, SDPA_ONLY), custom_split.SdpaStaticCacheLM)
    assert isinstance(wrap(tiny_llama(), "custom", 32, "last", 4, KV_ONLY), custom_split.UpdateCacheLM)


# ---------------------------------------------------------------------------------------------------
# the C++ kernels against the Python ops, in the ExecuTorch runtime (the program's buffers across executes)
# ---------------------------------------------------------------------------------------------------
class _Layer(torch.nn.Module):
    def __init__(self, slots, window, dtype):
        super().__init__()
        self.window = window
        self.register_buffer("kc", torch.zeros(1, 2, slots, 8, dtype=dtype))
        self.register_buffer("vc", torch.zeros(1, 2, slots, 4, dtype=dtype))

    def forward(self, q, k, v, pos):
        torch.ops.llmpipe.update_cache(k, v, self.kc, self.vc, pos)
        return torch.ops.llmpipe.sdpa(q, self.kc, self.vc, pos, self.window, 0.3)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("window", [0, 5], ids=["flat", "window5"])
def test_kernels_match_python_ops(dtype, tol, window, tmp_path):
    from executorch.exir import ExecutorchBackendConfig, to_edge
    from executorch.runtime import Runtime

    from pipeline import native
    if not native.kernels_library_path().exists():
        native.runner_path(build=True)
    T = torch.export.Dim("T", min=1, max=4)
    ex = (torch.zeros(1, 6, 2, 8, dtype=dtype), torch.zeros(1, 2, 2, 8, dtype=dtype),
          torch.zeros(1, 2, 2, 4, dtype=dtype), torch.arange(2))
    with torch.no_grad():
        ep = torch.export.export(_Layer(24, window, dtype), ex, dynamic_shapes=({2: T}, {2: T}, {2: T}, {0: T}))
    prog = to_edge(ep).to_executorch(ExecutorchBackendConfig(run_reinplace_pass=True))
    (tmp_path / "op.pte").write_bytes(prog.buffer)
    load_native_kernels()
    method = Runtime.get().load_program(str(tmp_path / "op.pte")).load_method("forward")
    ref = _Layer(24, window, dtype)
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
    # past the cache (positions 21..24 of 24): the kernel refuses, an error from execute, not a crash
    q, k, v = (torch.randn(1, h, 4, d, generator=g).to(dtype) for h, d in ((6, 8), (2, 8), (2, 4)))
    with pytest.raises(RuntimeError):
        method.execute([q, k, v, torch.arange(21, 25)])


# ---------------------------------------------------------------------------------------------------
# preflight
# ---------------------------------------------------------------------------------------------------
def _problems(*overrides):
    from pipeline import preflight
    from pipeline.errors import ConfigError
    try:
        preflight.check(compose_cfg("recipe=tiny_gemma3_custom", *overrides))
    except ConfigError as e:
        return e.problems
    return []


def test_preflight_takes_each_flag_alone_and_refuses_neither():
    assert _problems("cache.custom_kv_cache=false") == []
    assert _problems("cache.custom_sdpa=false") == []
    [(key, value, why)] = _problems("cache.custom_sdpa=false", "cache.custom_kv_cache=false")
    assert key == "cache.custom_sdpa/custom_kv_cache" and value == [False, False]
    assert "[[True, True], [True, False], [False, True]]" in why


def test_preflight_keeps_offgraph_apart_and_rings_for_the_fused_op():
    [(key, value, why)] = _problems("cache=offgraph", "cache.custom_sdpa=true")
    assert key == "cache.custom_sdpa/custom_kv_cache" and "cache.mode=offgraph" in why
    [(key, _, why)] = _problems("cache.custom_sdpa=false", "export.fault=ring_one_short")
    assert key == "export.fault" and "needs rings" in why
    assert CACHE_MODES["custom"].FLAGS[0] == BOTH  # conf/cache/custom.yaml's default: the fused op


def test_preflight_takes_each_flag_alone_on_mlx_too():
    """backend=mlx builds either half alone (tests/backends/test_mlx.py); both off is still the mode's refusal."""
    mlx = ("backend=mlx", "verify.native=false")
    assert _problems("cache.custom_kv_cache=false", *mlx) == []
    assert _problems("cache.custom_sdpa=false", *mlx) == []
    [(key, value, why)] = _problems("cache.custom_sdpa=false", "cache.custom_kv_cache=false", *mlx)
    assert key == "cache.custom_sdpa/custom_kv_cache" and value == [False, False]
    assert "[[True, True], [True, False], [False, True]]" in why and "backend=mlx" not in why
    from pipeline.backends import mlx as mlx_backend
    assert all(mlx_backend.refuses_cache("custom", f) is None for f in (BOTH, SDPA_ONLY, KV_ONLY))
    why = mlx_backend.refuses_cache("offgraph", BOTH)  # a combination no mode declares: named, with the allowed
    assert why == "allowed [custom_sdpa, custom_kv_cache]: [[False, False]]"
