"""export.fuse_projections (pipeline/model/layers/fused_projections.py, pipeline/backends/xnnpack/dynamic_slice.py):
q/k/v and gate/up run as one linear each, and the program computes the same bits with fewer operators.

- a fused build's program gives the unfused build's logits bit for bit, over prefill chunks and decode steps, with
  no more delegate calls or portable ops (the members' column slices stay inside the delegate);
- only siblings that share one quantization are fused; the eager module computes what it did;
- XNNPACK's slice of a dynamic tensor is taken only along a static dimension.
"""
from __future__ import annotations

import json
import pytest
import torch
from torch import nn

from tests.helpers import build, compose_cfg, stage_path

UP_TO_LOWER = ("download", "wrap", "quantize", "export", "lower")


def _program_logits(pte: str) -> list[torch.Tensor]:
    """The program's logits after each step of a fixed schedule of chunks and single tokens."""
    from pipeline.runtimes import RUNTIMES
    from pipeline.runtimes.base import RunnerProgram
    prog = RunnerProgram(RUNTIMES["executorch"], pte, kernels=("llmpipe",))
    ids = torch.randint(0, 500, (1, 64), generator=torch.Generator().manual_seed(0))
    out, pos = [], 0
    for step in (prog.chunk, 3, 1, 1, prog.chunk - 1, 1, prog.chunk):
        out.append(prog(ids[:, pos:pos + step], torch.arange(pos, pos + step)).clone())
        pos += step
    return out


def _metrics(manifest: dict, stage: str) -> dict:
    return json.loads((stage_path(manifest, stage) / "manifest.json").read_text())["metrics"]


@pytest.mark.parametrize("recipe,overrides,layers", [
    ("tiny_llama_custom", ("quantize=8da4w",), 2),     # dynamic int8 activations, in-graph cache
    ("tiny_gemma3_offgraph", (), 3),                   # fp32, off-graph rings, q/k norms, tanh GELU
])
def test_a_fused_program_gives_the_unfused_bits(recipe, overrides, layers):
    # up to lower: the gates of a tiny random 8da4w model are not the point here
    fused = build(recipe, *overrides, stages=UP_TO_LOWER)
    plain = build(recipe, *overrides, "export.fuse_projections=false", stages=UP_TO_LOWER)
    report = _metrics(fused, "export")["fused_projections"]
    assert report == {"qkv_proj": layers, "gate_up_proj": layers, "kept": 0}
    a, b = _program_logits(stage_path(fused, "lower") / "model.pte"), _program_logits(stage_path(plain, "lower") / "model.pte")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    fm, pm = _metrics(fused, "lower"), _metrics(plain, "lower")
    assert fm["delegate_calls"] <= pm["delegate_calls"] and fm["portable_ops"] <= pm["portable_ops"]
    assert fm["delegation_by_op"]["aten_linear_default"]["delegated"] == \
        pm["delegation_by_op"]["aten_linear_default"]["delegated"] - 3 * layers  # 3 -> 1 and 2 -> 1 a layer
    def slices(m):  # the fused projections' splits add none outside the delegate
        return m["delegation_by_op"].get("aten_slice_copy_tensor", {}).get("non_delegated", 0)
    assert slices(fm) == slices(pm)


def _tiny_quantized(arch: str, *overrides: str):
    from pipeline.model.cache_modes import wrap
    from pipeline.model.quant.apply import quantize_module
    from tests.model.test_offgraph import tiny_gemma3
    cfg = compose_cfg("recipe=tiny_llama_custom", *overrides)
    model = tiny_gemma3() if arch == "gemma3" else _tiny_llama()
    module = wrap(model, "custom", 64, "full", chunk=16)
    quantize_module(module, cfg.quantize)
    return module


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("quantize", ["none", "8da4w"])
def test_the_eager_module_computes_what_it_did(arch, quantize):
    from pipeline.model.layers.fused_projections import ProjectionSlice, fuse_projections
    module = _tiny_quantized(arch, f"quantize={quantize}")
    tokens, positions = torch.tensor([[1, 7, 9, 30, 2]]), torch.arange(5)
    with torch.no_grad():
        before = module(tokens, positions)
        report = fuse_projections(module.model)
        after = module(tokens, positions)
    layers = len(module.model.model.layers)
    assert report == {"qkv_proj": layers, "gate_up_proj": layers, "kept": 0}
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    attn = module.model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, ProjectionSlice) and isinstance(attn.qkv_proj, nn.Linear)
    assert attn.qkv_proj.out_features == attn.q_proj.stop + (attn.k_proj.stop - attn.k_proj.start) * 2


def test_siblings_of_different_quantization_are_kept_apart():
    """An override that gives v_proj 8 bits leaves q/k/v as they were; gate/up (both 8da4w) are still fused."""
    from pipeline.model.layers.fused_projections import fuse_projections
    module = _tiny_quantized("llama", "quantize=8da4w",
                             "+quantize.overrides=[{pattern: '*.v_proj', scheme: 8da8w, group_size: 0}]")
    report = fuse_projections(module.model)
    assert report == {"qkv_proj": 0, "gate_up_proj": 2, "kept": 2}  # the tiny llama's 2 layers
    assert isinstance(module.model.model.layers[1].self_attn.v_proj, nn.Linear)


def test_xnnpack_slices_a_dynamic_tensor_only_along_a_static_dimension():
    from pipeline.backends.xnnpack.dynamic_slice import _static_slice_of_dynamic_tensor
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode(shape_env=ShapeEnv())
    T = mode.shape_env.create_unbacked_symint()
    with mode:
        x = torch.empty(1, T, 96)
        y = torch.empty(1, 4, 96)

    def node(val, dim, start, end, step=1):
        graph = torch.fx.Graph()
        inp = graph.placeholder("x")
        inp.meta["val"] = val
        n = graph.call_function(torch.ops.aten.slice_copy.Tensor, (inp, dim, start, end, step))
        return n
    assert _static_slice_of_dynamic_tensor(node(x, 2, 0, 64))
    assert _static_slice_of_dynamic_tensor(node(x, -1, 64, 96))
    assert not _static_slice_of_dynamic_tensor(node(x, 1, 0, 1))       # the dynamic dimension itself
    assert not _static_slice_of_dynamic_tensor(node(x, 2, 0, 64, 2))   # a stride
    assert not _static_slice_of_dynamic_tensor(node(y, 2, 0, 64))      # static: the stock config's case
