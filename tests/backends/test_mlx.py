"""backend=mlx: lowering through the MLX delegate here, and verify through our interpreter (pipeline/runtimes/mlx).

Tiny random models of both architectures, every cache mode and quantization scheme the MLX recipes
use; the real-model builds are in tests/e2e/test_mlx_real.py.
"""
from __future__ import annotations


import pytest
import torch

from pipeline import abi
from pipeline.paths import ROOT
from pipeline.runtimes import open_program
from pipeline.runtimes.base import run_sequence
from pipeline.runtimes.mlx import ops
from pipeline.runtimes.mlx.payload import UnsupportedInstruction
from pipeline.runtimes.mlx.program import MLXProgram, coverage
from tests.helpers import build, run_cli, stage_path


def _stage(m, name):
    return next(s for s in m["stages"] if s["name"] == name)


def test_mlx_delegate_imports_after_schema_generation():
    from pipeline.backends.mlx import schema as mlx_schema
    mlx_schema.ensure()
    assert mlx_schema.is_generated()
    from executorch.backends.mlx import MLXPartitioner  # noqa: F401


CASES = {
    "llama custom (tiny_llama_mlx)": ("tiny_llama_mlx",),
    "llama custom int4 (tiny_llama_mlx_int4)": ("tiny_llama_mlx_int4",),
    "gemma3 offgraph (tiny_gemma3_mlx_offgraph)": ("tiny_gemma3_mlx_offgraph",),
    "llama static": ("tiny_llama_mlx", "cache=static"),
    "gemma3 static": ("tiny_gemma3_mlx_offgraph", "cache=static"),
    "gemma3 custom, rings": ("tiny_gemma3_mlx_offgraph", "cache=custom"),
    "llama 8w per channel": ("tiny_llama_mlx", "quantize=8w", "quantize.linear_group_size=0",
                             "quantize.embedding_group_size=0"),
    "llama nvfp4": ("tiny_llama_mlx", "quantize=nvfp4"),
    "gemma3 offgraph 4w": ("tiny_gemma3_mlx_offgraph", "quantize=4w"),
    # the MLX example's --use-custom-sdpa / --use-custom-kv-cache one at a time (attention.py)
    "llama custom_sdpa alone": ("tiny_llama_mlx", "cache.custom_kv_cache=false"),
    "llama custom_kv_cache alone": ("tiny_llama_mlx", "cache.custom_sdpa=false"),
}
# the MLX example's commands at its default dtype (bf16): the half gate, not the exact one
BF16_CASES = {
    "llama custom bf16 (tiny_llama_mlx_bf16)": ("tiny_llama_mlx_bf16",),
    "gemma3 offgraph bf16 (tiny_gemma3_mlx_offgraph_bf16)": ("tiny_gemma3_mlx_offgraph_bf16",),
}
# the same on Gemma 3's sliding layers (window masks over flat caches): ~2 min more
SLOW_CASES = {
    "gemma3 custom_sdpa alone": ("tiny_gemma3_mlx_offgraph", "cache=custom", "cache.custom_kv_cache=false"),
    "gemma3 custom_kv_cache alone": ("tiny_gemma3_mlx_offgraph", "cache=custom", "cache.custom_sdpa=false"),
}


class _Builds(dict):
    """Each case built when a test first asks for it (a -k selection builds only what it needs)."""

    def __missing__(self, name):
        self[name] = build(*{**CASES, **BF16_CASES, **SLOW_CASES}[name])
        return self[name]


@pytest.fixture(scope="module")
def built():
    return _Builds()


def _fully_delegated_and_exact(m):
    """The whole graph in one MLX delegate, verify through our interpreter within the exact fp32 gate;
    returns the delegation report by op."""
    assert m["status"] == "ok", m.get("error")
    lower = _stage(m, "lower")["metrics"]
    # the delegation report, by op, is in the manifest: everything but the delegate's getitem is inside
    by_op = lower["delegation_by_op"]
    assert by_op and all(c["non_delegated"] == 0 for op, c in by_op.items() if op != "getitem"), by_op
    assert lower["delegated_subgraphs"] == 1
    v = m["verify"]
    assert v["runtime"].startswith("pipeline.runtimes.mlx")
    same = v["same_quant"]
    assert same["greedy_match"] == same["greedy_total"] > 0
    assert same["max_logit_err"] < 1e-4 and same["top1"] == 1.0
    return by_op


@pytest.mark.parametrize("name", list(CASES))
def test_builds_fully_delegated_and_verifies_exactly(built, name):
    _fully_delegated_and_exact(built[name])


@pytest.mark.parametrize("name", list(BF16_CASES))
def test_bf16_builds_fully_delegated_within_the_half_gate(built, name):
    """bf16 end to end: the delegate takes every op, the interpreter runs bf16 (K/V in bf16 too), and verify holds
    the program to bf16 eager relative to the build's own bf16 numerics floor."""
    m = built[name]
    assert m["status"] == "ok", m.get("error")
    lower = _stage(m, "lower")["metrics"]
    assert lower["delegated_subgraphs"] == 1
    assert all(c["non_delegated"] == 0 for op, c in lower["delegation_by_op"].items() if op != "getitem")
    v = m["verify"]
    assert v["gate"] == "half" and v["runtime"].startswith("pipeline.runtimes.mlx")
    assert v["same_quant"]["kld"] <= 1.5 * v["floor"]["kld"]
    dtype = open_program(stage_path(m, "lower")).constant(abi.ACTIVATION_DTYPE)
    assert dtype == abi.SCALAR_TYPE_CODES[abi.DTYPES["bf16"]]


def _split_ops(m, sdpa_alone: bool):
    """Where each half of cache=custom went: the ops inside the delegate and the MLX instructions."""
    by_op = _fully_delegated_and_exact(m)
    inside = {op for op, c in by_op.items() if c["delegated"] > 0}
    program = set(MLXProgram(m["pte"]).ops())
    if sdpa_alone:  # HF's StaticCache writes with index_copy_, mlx::custom_sdpa attends (no aten SDPA left)
        assert {"aten_index_copy_default", "mlx_custom_sdpa_default"} <= inside, inside
        assert "aten_scaled_dot_product_attention_default" not in by_op and "auto_functionalized_v2" not in by_op
        assert {"IndexCopyNode", "SdpaNode"} <= program and "SliceUpdateNode" not in program, program
    else:  # mlx::kv_cache_update (auto_functionalized in the graph, SliceUpdateNode in MLX) + aten SDPA with a mask
        assert {"auto_functionalized_v2", "aten_scaled_dot_product_attention_default"} <= inside, inside
        assert "mlx_custom_sdpa_default" not in by_op and "aten_index_copy_default" not in by_op
        assert {"SliceUpdateNode", "SdpaNode"} <= program and "IndexCopyNode" not in program, program
    assert m["verify"]["gate"] == "exact"
    return program


@pytest.mark.parametrize("sdpa_alone", [True, False], ids=["custom_sdpa", "custom_kv_cache"])
def test_each_custom_flag_alone_lowers_its_own_half_on_mlx(built, sdpa_alone):
    name = "llama custom_sdpa alone" if sdpa_alone else "llama custom_kv_cache alone"
    _split_ops(built[name], sdpa_alone)
    export = _stage(built[name], "export")["metrics"]
    assert export["attention"].startswith("HF StaticCache" if sdpa_alone else "mlx::kv_cache_update + masked")


@pytest.mark.slow  # ~2 min: two tiny Gemma 3 builds
@pytest.mark.parametrize("sdpa_alone", [True, False], ids=["custom_sdpa", "custom_kv_cache"])
def test_each_custom_flag_alone_keeps_gemma3_windows_on_mlx(built, sdpa_alone):
    """Sliding layers over flat caches: the window is a mask (either flag alone has no rings); 56 tokens go
    past the window of 16 and match eager."""
    name = "gemma3 custom_sdpa alone" if sdpa_alone else "gemma3 custom_kv_cache alone"
    program = _split_ops(built[name], sdpa_alone)
    assert "WhereNode" in program  # the window mask
    _past_the_window_matches_eager(built[name])


def test_quantized_programs_use_mlx_quantized_kernels(built):
    for name, bits in (("llama custom int4 (tiny_llama_mlx_int4)", 4), ("llama nvfp4", 4),
                       ("llama 8w per channel", 8)):
        ops = MLXProgram(built[name]["pte"]).ops()
        assert "QuantizedMatmulNode" in ops, name          # linears stay packed
        assert "AddmmNode" not in ops, name
    float_ops = MLXProgram(built["llama custom (tiny_llama_mlx)"]["pte"]).ops()
    assert "QuantizedMatmulNode" not in float_ops


def test_interpreter_covers_every_instruction_of_the_mlx_recipes(built):
    """Every MLX recipe (real ones included: the same architectures, modes and schemes as these tiny
    builds) emits only instructions the interpreter has a handler for."""
    seen: dict[str, set] = {}
    for name in {**CASES, **BF16_CASES}:
        for op in MLXProgram(built[name]["pte"]).ops():
            seen.setdefault(op, set()).add(name)
    uncovered = {op: sorted(where) for op, where in seen.items() if not ops.Interpreter.covers(op)}
    assert not uncovered, f"instructions without an interpreter handler: {uncovered}"
    assert {"UpdateAndAttendNode", "SdpaNode", "QuantizedMatmulNode", "SliceUpdateNode", "RMSNormNode"} <= set(seen)


def test_every_mlx_recipe_has_a_tiny_twin_covered_here():
    """The coverage test above stands for the real recipes through their tiny twins (Gemma 4's, a 5-minute build, in
    the slow tier's tests/e2e/test_gemma4_tiny.py, which checks coverage the same way)."""
    from tests.e2e.test_gemma4_tiny import RECIPES as GEMMA4_SLOW_TIER
    real = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")
                  if "backend: mlx" in p.read_text() and not p.stem.startswith("tiny_"))
    assert set(real) >= {"llama_mlx", "llama_mlx_int4", "gemma3_mlx_offgraph", "gemma4_mlx_4w"}
    tiny = {args[0] for args in {**CASES, **BF16_CASES}.values()} | {r for (backend, _), r in GEMMA4_SLOW_TIER.items() if backend == "mlx"}
    assert all(f"tiny_{r}" in tiny for r in real), (real, tiny)


def _eager_and_program(m):
    eager = torch.load(stage_path(m, "quantize") / "module.pt", weights_only=False)
    return eager, open_program(stage_path(m, "lower"))


@pytest.mark.parametrize("name", ["gemma3 offgraph (tiny_gemma3_mlx_offgraph)", "gemma3 custom, rings"])
def test_past_the_window_the_rings_wrap_and_match_eager(built, name):
    """Window 16, chunk 8: rings of 23 slots in a context of 64; 56 tokens wrap them twice."""
    _past_the_window_matches_eager(built[name])


def _past_the_window_matches_eager(m):
    eager, prog = _eager_and_program(m)
    ids = torch.randint(3, 512, (56,), generator=torch.Generator().manual_seed(1)).tolist()
    eager.reset()
    prog.reset()
    errs = []
    for start in range(0, 40, 8):  # chunked prefill
        piece = ids[start:start + 8]
        errs.append((run_sequence(eager, piece, 8, start=start)
                     - run_sequence(prog, piece, 8, start=start)).abs().max().item())
    for i in range(40, 56):  # decode
        errs.append((run_sequence(eager, [ids[i]], 1, start=i)
                     - run_sequence(prog, [ids[i]], 1, start=i)).abs().max().item())
    assert max(errs) < 1e-4, errs


def test_offgraph_program_rewinds_like_the_runners(built):
    eager, prog = _eager_and_program(built["gemma3 offgraph (tiny_gemma3_mlx_offgraph)"])
    ids = list(range(10, 30))
    a = run_sequence(prog, ids, 8)
    run_sequence(prog, [7, 8, 9], 1, start=len(ids))
    b = run_sequence(prog, ids[12:], 8, start=12)  # rewind to 12 and redo the tail
    assert torch.equal(a, b)
    assert prog.cache.length == len(ids)


def test_an_instruction_without_a_handler_fails_the_gate(built, monkeypatch, tmp_path):
    """A program the interpreter cannot fully run is `unsupported: <op>`, a failed gate, never a pass."""
    m = built["llama custom (tiny_llama_mlx)"]
    monkeypatch.delattr(ops.Interpreter, "op_RMSNormNode")
    prog = open_program(stage_path(m, "lower"))
    with pytest.raises(UnsupportedInstruction, match="unsupported: RMSNormNode"):
        prog(torch.tensor([[1, 2]]), torch.arange(2))
    assert coverage(m["pte"])["uncovered"] == ["RMSNormNode"]

    # through the verify stage (a verify key of its own, so it re-runs): the gate fails by default...
    from pipeline.errors import StageError
    with pytest.raises(StageError, match="unsupported: RMSNormNode"):
        build("tiny_llama_mlx", "verify.max_new_tokens=3")
    # ...and with verify.fail_on_unsupported=false the status is recorded, the checks skipped
    recorded = build("tiny_llama_mlx", "verify.max_new_tokens=3", "verify.fail_on_unsupported=false")
    assert recorded["status"] == "ok"
    assert recorded["verify"]["status"] == "unsupported: RMSNormNode"
    assert "same_quant" not in recorded["verify"]


def test_mlx_with_the_cpp_runner_is_refused_before_any_work():
    r = run_cli("recipe=tiny_llama_mlx", "verify.native=true")
    assert r.returncode == 2
    assert "verify.native" in r.stderr and "backend=mlx" in r.stderr and "Traceback" not in r.stderr


class _Router(torch.nn.Module):
    """What ERNIE 4.5 MoE's and LFM2-MoE's routers and Apertus' activation compute: top-k after a bias, the unbiased
    scores gathered, a clamped normalization, expm1; and Nemotron-H's group mask: the best group's experts only
    (scatter of a value into zeros)."""

    def forward(self, logits, bias):
        probs = torch.softmax(logits, -1)
        _, idx = torch.topk(probs + bias, 2, dim=-1)
        picked = torch.gather(probs, 1, idx)
        groups = probs.view(-1, 2, 4).sum(-1)                                         # two groups of four experts
        mask = torch.zeros_like(groups).scatter_(1, torch.topk(groups, 1, dim=-1)[1], 1.0)
        in_group = probs.masked_fill(~mask.repeat_interleave(4, 1).bool(), 0.0)
        return picked / picked.sum(-1, keepdim=True).clamp(min=1e-12), torch.expm1(logits.clamp(max=0.5)), in_group


def test_a_router_that_gathers_lowers_whole_to_mlx_and_runs(tmp_path):
    """aten.gather as TakeAlongAxisNode and aten.scatter.value through ScatterAddNode (pipeline/backends/mlx/gather.py),
    ClipNode and Expm1Node in the interpreter."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from pipeline.backends import BACKENDS
    from pipeline.runtimes.mlx import load
    logits, bias = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)), torch.linspace(0, 0.1, 8)
    ep = torch.export.export(_Router(), (logits, bias))
    partitioners, passes = BACKENDS["mlx"].partition()
    edge = to_edge_transform_and_lower(ep, partitioner=partitioners, transform_passes=passes,
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    (tmp_path / "router.pte").write_bytes(edge.to_executorch(BACKENDS["mlx"].executorch_config(None)).buffer)
    program = load(tmp_path / "router.pte")  # a kernel call outside the delegate would be refused here
    assert {"TakeAlongAxisNode", "ScatterAddNode", "ClipNode", "Expm1Node"} <= set(program.ops())
    got = program.execute([logits, bias])
    for g, w in zip(got, _Router()(logits, bias)):
        assert torch.allclose(torch.as_tensor(g), w, atol=1e-6)
