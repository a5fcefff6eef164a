"""The `stock` KV-cache mode: programs on ExecuTorch's own operators alone (llama::update_cache, llama::custom_sdpa).
Its wrapper against HF's own forward, its export, native/'s twins of the two ops against ExecuTorch's kernels, and
tiny builds that verify under the exact gate with no operator of ours in the program. Tiny random models only.
"""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from pipeline import native, ops
from pipeline.model.cache_modes import CACHE_MODES, logits_mode, wrap
from pipeline.model.cache_modes import stock
from tests.helpers import build, compose_cfg, stage_path
from tests.model.test_offgraph import feed, tiny_gemma3, tiny_llama

TOL = 1e-4


# ---------------------------------------------------------------------------------------------------
# the wrapper
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make,chunk", [(tiny_llama, 8), (tiny_llama, 1), (tiny_gemma3, 8), (tiny_gemma3, 1),
                                        (tiny_gemma3, 16)],
                         ids=["llama-chunk8", "llama-decode", "gemma3-chunk8", "gemma3-decode", "gemma3-chunk16"])
def test_wrapped_model_matches_hf(make, chunk):
    """45 tokens: past gemma3's window of 16, so its sliding layers' masks are exercised."""
    model = make()
    ids = torch.randint(0, 128, (1, 45), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
    w = wrap(model, "stock", 64, "full", chunk)
    assert isinstance(w, stock.StockCacheLM)
    assert (feed(w, ids, chunk) - ref).abs().max().item() < TOL
    with torch.no_grad():  # HF attention restored afterwards
        assert torch.allclose(model(ids, use_cache=False).logits, ref)


def test_every_layer_keeps_a_flat_cache_of_the_whole_context():
    w = wrap(tiny_gemma3(), "stock", 64, "last", 8)
    caches = {n: tuple(b.shape) for n, b in w.named_buffers() if n.endswith("k_cache")}
    assert len(caches) == 3 and set(caches.values()) == {(1, 64, 1, 16)}  # sliding layers too: no rings
    assert w.cache_bytes() == 2 * 3 * 64 * 16 * 4


def test_window_mask_is_additive_and_banded():
    m = stock.window_mask(torch.arange(5, 8), 10, 3)
    assert m.dtype == torch.float32 and m.shape == (3, 10) and m.is_contiguous()
    assert (m == 0).nonzero().tolist() == [[0, 3], [0, 4], [0, 5], [1, 4], [1, 5], [1, 6], [2, 5], [2, 6], [2, 7]]
    assert bool(torch.isneginf(m[m != 0]).all())


def test_positions_are_checked_before_the_ops_see_them():
    w = wrap(tiny_llama(), "stock", 16, "last", 8)
    with pytest.raises(ValueError, match=r"positions \[12, 18\) exceed the cache's 16"):
        w(torch.zeros(1, 6, dtype=torch.long), torch.arange(12, 18))
    with pytest.raises(ValueError, match="consecutive"):
        w(torch.zeros(1, 3, dtype=torch.long), torch.tensor([0, 2, 3]))


def test_auto_logits_mode_is_tail_and_the_mode_declares_executorch_ops_only():
    cfg = compose_cfg("recipe=tiny_llama_custom", "cache=stock")
    assert logits_mode(cfg) == "tail"
    m = CACHE_MODES["stock"]
    assert m.EXECUTORCH_OPS_ONLY and not m.RUNTIME_OWNED and m.KERNELS == ("llama",)
    assert m.sdpa_with_kv_cache(m.FLAGS[0]) and not m.rings(m.FLAGS[0])


def test_export_calls_executorch_ops_only():
    w = wrap(tiny_gemma3(), "stock", 64, "last", 8)
    T = torch.export.Dim("T", min=1, max=8)
    with torch.no_grad():
        ep = torch.export.export(w, (torch.tensor([[1, 2]]), torch.arange(2)), dynamic_shapes=({1: T}, {0: T}),
                                 strict=False).run_decompositions({})
    mutated = sorted(ep.graph_signature.buffers_to_mutate.values())
    assert mutated == sorted(f"model.model.layers.{i}.self_attn.{c}_cache" for i in range(3) for c in "kv")
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if "llmpipe" in t]
    assert sum("custom_sdpa" in t for t in targets) == 3
    assert targets.count("aten.item.default") == 1  # one start position a forward, for every layer


# ---------------------------------------------------------------------------------------------------
# native/'s twins (kernels/llama_twins.cpp) against ExecuTorch's own kernels
# ---------------------------------------------------------------------------------------------------
def _sdpa_case(name, B, T, Hq, Hkv, D, S, start, *, causal=True, mask=None, scale=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, h, D, generator=g).to(dtype) for n, h in ((T, Hq), (S, Hkv), (S, Hkv)))
    return {"name": name, "op": "custom_sdpa", "start_pos": start, "is_causal": causal, "scale": scale,
            "tensors": {"q": q, "k": k, "v": v, **({"mask": mask} if mask is not None else {})}}


def _random_mask(T, S, seed=1):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(T, S, generator=g)
    m[torch.rand(T, S, generator=g) < 0.4] = float("-inf")
    m[:, 0] = 0.5  # no row without a visible key
    return m


def twin_cases() -> list[dict]:
    g = torch.Generator().manual_seed(3)
    cases = [
        _sdpa_case("prefill gqa3", 1, 7, 6, 2, 64, 16, 0),
        _sdpa_case("chunk at 6 gqa4", 1, 5, 4, 1, 32, 16, 6),
        _sdpa_case("decode at 11 gqa3", 1, 1, 9, 3, 64, 16, 11),
        _sdpa_case("d12 (not 8 lanes)", 1, 3, 2, 2, 12, 8, 2),
        _sdpa_case("not causal, no mask", 1, 3, 4, 2, 16, 12, 4, causal=False),
        _sdpa_case("sliding window mask", 1, 4, 4, 1, 16, 16, 9, causal=False,
                   mask=stock.window_mask(torch.arange(9, 13), 16, 5)),
        _sdpa_case("random additive mask", 1, 5, 6, 3, 16, 20, 0, causal=False, mask=_random_mask(5, 20)),
        _sdpa_case("explicit scale", 1, 4, 4, 2, 16, 12, 3, scale=0.3),
        _sdpa_case("batch 2", 2, 3, 4, 2, 16, 10, 5),
        _sdpa_case("fp16 causal", 1, 3, 4, 2, 32, 12, 5, dtype=torch.float16),
        _sdpa_case("fp16 window mask", 1, 2, 4, 2, 32, 12, 6, causal=False, dtype=torch.float16,
                   mask=stock.window_mask(torch.arange(6, 8), 12, 4)),
    ]
    for name, B, T, H, D, S, start, dtype in (("update at 4", 1, 3, 2, 8, 10, 4, torch.float32),
                                              ("update batch 2", 2, 2, 3, 4, 6, 4, torch.float32),
                                              ("update fp16", 1, 5, 1, 16, 5, 0, torch.float16)):
        cases.append({"name": name, "op": "update_cache", "start_pos": start,
                      "tensors": {"value": torch.randn(B, T, H, D, generator=g).to(dtype),
                                  "cache": torch.randn(B, S, H, D, generator=g).to(dtype)}})
    return cases


def executorch_kernels(case: dict) -> torch.Tensor:
    """What ExecuTorch's own kernels compute (their eager AOT library)."""
    t = {k: x.clone() for k, x in case["tensors"].items()}
    if case["op"] == "update_cache":
        torch.ops.llama.update_cache(t["value"], t["cache"], case["start_pos"])
        return t["cache"]
    return torch.ops.llama.custom_sdpa(t["q"], t["k"], t["v"], case["start_pos"], t.get("mask"), 0.0,
                                       case["is_causal"], case["scale"])


def run_twins(cases: list[dict], folder, threads: int, command: list[str] | None = None) -> dict:
    """The twins' outputs on the cases (`command`: llama_twins_test's command line, when it runs under QEMU)."""
    folder.mkdir(exist_ok=True)
    spec = []
    for c in cases:
        entry = {k: c.get(k) for k in ("name", "op", "start_pos", "is_causal", "scale")}
        entry["dtype"] = str(next(iter(c["tensors"].values())).dtype).split(".")[-1]
        entry["mask"] = "mask" in c["tensors"]
        for key, x in c["tensors"].items():
            (folder / f"{c['name']}.{key}").write_bytes(x.contiguous().view(torch.uint8).numpy().tobytes())
            entry[f"{key}_shape"] = list(x.shape)
        spec.append(entry)
    (folder / "cases.json").write_text(json.dumps(spec))
    proc = subprocess.run([*(command or [str(native.BUILD_DIR / "llama_twins_test")]), str(folder), str(threads)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = {}
    for c in cases:
        like = c["tensors"]["cache" if c["op"] == "update_cache" else "q"]
        raw = bytearray((folder / f"{c['name']}.out").read_bytes())
        out[c["name"]] = torch.frombuffer(raw, dtype=torch.uint8).view(like.dtype).reshape(like.shape)
    return out


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
    binary = native.BUILD_DIR / "llama_twins_test"
    if not binary.exists() or native._stale(binary):
        native.build_native(force=True)
    cases = twin_cases()
    root = tmp_path_factory.mktemp("twins")
    return cases, run_twins(cases, root / "t2", 2), run_twins(cases, root / "t1", 1)


@pytest.mark.parametrize("name", [c["name"] for c in twin_cases()])
def test_twin_equals_executorch_kernel(name, twins):
    cases, got, one_thread = twins
    case = next(c for c in cases if c["name"] == name)
    want = executorch_kernels(case)
    assert got[name].dtype == want.dtype and got[name].shape == want.shape
    if case["op"] == "update_cache":
        assert torch.equal(got[name], want)
    else:
        tol = 2e-3 if want.dtype == torch.float16 else 2e-6
        assert (got[name].float() - want.float()).abs().max().item() < tol
    assert torch.equal(got[name], one_thread[name])  # a row's bits do not depend on the thread count


# ---------------------------------------------------------------------------------------------------
# builds: the exact gate, and nothing of ours in the program
# ---------------------------------------------------------------------------------------------------
def _no_ops_of_ours(m: dict) -> dict:
    assert m["status"] == "ok", m.get("error")
    dep = m["deploy"]
    assert not [op for op in dep["operators"] if op.startswith("llmpipe::")], dep["operators"]
    assert dep["needs_ours"] is False
    assert set(dep["beyond_stock"]) == {"llama::custom_sdpa.out", "llama::update_cache.out"}
    assert "llama" in dep["namespaces"] and dep["runners"]["text_llm_runner"]
    assert ops.describe(dep) == ("ExecuTorch's own operators only (its LLM custom ops: llama::custom_sdpa.out, "
                                 "llama::update_cache.out)")
    return dep


@pytest.mark.parametrize("recipe", ["tiny_llama_custom", "tiny_gemma3_custom"])
def test_tiny_builds_verify_exactly_on_executorch_ops_alone(recipe):
    m = build(recipe, "cache=stock", "quantize=none")
    _no_ops_of_ours(m)
    v = m["verify"]
    assert v["gate"] == "exact" and v["native"]["token_parity"] is True  # our twins give the Python runtime's tokens
    methods = json.loads((stage_path(m, "lower") / "lower.json").read_text())["constant_methods"]
    assert methods["get_logits_to_keep_mode"] == 3 and methods["use_sdpa_with_kv_cache"] is True  # tail


def test_experts_export_as_plain_linears():
    """A mixture of experts without llmpipe::experts: every expert on every row, weighted by the router."""
    from tests.e2e.test_families import build_family
    m = build_family("qwen3_moe", "xnnpack", "stock", "fp32")
    _no_ops_of_ours(m)
    assert m["verify"]["gate"] == "exact" and m["verify"]["native"]["token_parity"] is True
    export = next(s for s in m["stages"] if s["name"] == "export")
    assert export["metrics"]["dense_expert_layers"] == 4 and "expert_layers" not in export["metrics"]


def test_a_tied_8bit_head_stays_a_linear():
    """The default build stores a tied 8-bit head once through llmpipe::tied_head; this mode keeps the linear."""
    m = build("tiny_llama_custom", "cache=stock", "model.random.tie_word_embeddings=true", "quantize=8da4w_mixed")
    _no_ops_of_ours(m)
    export = next(s for s in m["stages"] if s["name"] == "export")
    assert export["metrics"]["tied_head"] is False and "cache.mode=stock" in export["metrics"]["tied_head_why"]


def test_near_tie_gap_is_how_far_below_the_best_a_pick_sat():
    """verify's check of a runner on twinned kernels: teacher-forced on that runner's tokens, the Python runtime's
    logits say how far below its own best each pick sat."""
    from pipeline.stages.verify import near_tie_gap
    table = {0: [0.0] * 4, 1: [0.0, 0.5, 1.0, 0.2], 2: [3.0, 0.0, 0.0, 2.7]}  # the logits after each position

    def program(tokens, positions):
        return torch.tensor([[table[int(p)] for p in positions]])

    assert near_tie_gap(program, [0, 1], [2, 3], chunk=4) == pytest.approx(0.3)
    assert near_tie_gap(program, [0, 1], [2, 0], chunk=4) == 0.0
