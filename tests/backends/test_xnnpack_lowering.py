"""How the XNNPACK backend lowers: the glue between matmuls inside the delegate (pipeline/backends/xnnpack/glue.py).
The lean lowering's bytes against the stock lowering's: tests/exporters/test_lean_lowering.py."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.helpers import build, stage_path


class Glue(nn.Module):
    """An RMSNorm, a head split, RoPE (cos/sin unsqueezed, rotate_half) and a tanh GELU, T dynamic."""

    def __init__(self, heads=2, dim=16):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.dim = heads, dim
        self.proj = nn.Linear(heads * dim, heads * dim)
        self.norm = nn.Parameter(torch.rand(heads * dim) + 0.5)

    def forward(self, x, cos, sin):
        t = x.shape[1]
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
        q = self.proj(x).view(1, t, self.heads, self.dim).transpose(1, 2)
        half = self.dim // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        q = q * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
        out = q.transpose(1, 2).reshape(1, t, self.heads * self.dim)
        return nn.functional.gelu(out, approximate="tanh")


def _lower(module, example, dynamic, passes):
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from pipeline.backends.xnnpack.weight_only import partitioner
    ep = torch.export.export(module, example, dynamic_shapes=dynamic, strict=True)
    edge = to_edge_transform_and_lower(ep, partitioner=[partitioner()], transform_passes=passes,
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False,
                                                                        _skip_dim_order=True))
    outside = [str(n.target) for n in edge.exported_program().graph.nodes
               if n.op == "call_function" and "executorch_call_delegate" not in str(n.target)
               and "getitem" not in str(n.target)]
    buffer = edge.to_executorch().buffer
    program = Runtime.get().load_program(buffer)
    method = program.load_method("forward")
    method.keep = (buffer, program)  # the runtime reads the program's bytes in place
    return method, outside


def test_the_glue_lowers_inside_one_delegate_call_and_computes_the_same():
    from pipeline.backends.xnnpack.glue import delegable_glue
    module = Glue().eval()
    T = torch.export.Dim("T", min=1, max=16)
    example = (torch.randn(1, 4, 32), torch.randn(1, 4, 16), torch.randn(1, 4, 16))
    glued, outside = _lower(module, example, ({1: T}, {1: T}, {1: T}), [delegable_glue])
    assert outside == []
    stock, stock_outside = _lower(module, example, ({1: T}, {1: T}, {1: T}), None)
    assert len(stock_outside) >= 6  # mean, views, unsqueezes, slices, the tanh GELU: each a split in the delegate
    for t in (1, 5, 16):
        x, cos, sin = torch.randn(1, t, 32), torch.randn(1, t, 16), torch.randn(1, t, 16)
        want = module(x, cos, sin)
        got = glued.execute([x, cos, sin])[0]
        assert (got - want).abs().max().item() < 1e-5, t
        assert (got - stock.execute([x, cos, sin])[0]).abs().max().item() < 1e-5, t


def test_rotate_half_as_a_matmul_is_exact():
    from pipeline.backends.xnnpack.glue import delegable_glue

    class Rot(nn.Module):
        def forward(self, q):
            return torch.cat((-q[..., 8:], q[..., :8]), dim=-1)
    T = torch.export.Dim("T", min=1, max=16)
    method, outside = _lower(Rot(), (torch.randn(1, 2, 4, 16),), ({2: T},), [delegable_glue])
    assert outside == []
    q = torch.randn(1, 2, 7, 16) * 1e3
    assert torch.equal(method.execute([q])[0], Rot()(q))


@pytest.fixture(scope="module")
def tiny_custom():
    """tiny Llama 8da4w (the default's quantization) with the custom cache: its lower.json."""
    m = build("tiny_llama_custom", "quantize=8da4w_mixed", stages=("download", "wrap", "quantize", "export", "lower"))
    return m


def test_a_decoder_layer_is_one_delegate_call(tiny_custom):
    report = json.loads((stage_path(tiny_custom, "lower") / "lower.json").read_text())
    layers = tiny_custom["config"]["model"]["random"]["num_hidden_layers"]
    outside = {op: b["non_delegated"] for op, b in report["by_op"].items() if b["non_delegated"] and op != "getitem"}
    # split by each layer's attention op, plus the RoPE angles before the first layer; the lm_head, tied to the
    # 8-bit embedding, runs outside on llmpipe::tied_head over the embedding's table (once per forward)
    assert report["delegated_subgraphs"] == layers + 2
    assert outside.pop("auto_functionalized_v2") == layers
    assert outside.pop("llmpipe_tied_head_default") == 1
    # what stays outside is computed once per forward, before the first layer (positions, embedding, RoPE angles),
    # one view of the positions per layer, and the rows kept: logits mode `tail`, the default here, computes their
    # indices from T in scalar ops (sym_size, sym_min, sub, scalar_tensor, arange, add) and gathers them (index)
    assert outside.pop("aten_view_copy_default") <= layers + 2
    for op in ("sym_size", "sym_min", "sub", "scalar_tensor", "aten_arange_start_step", "aten_index_tensor"):
        assert outside.pop(op) == 1, op
    assert sum(outside.values()) <= 7, outside
