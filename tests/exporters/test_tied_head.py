"""A tied weight is stored once: llmpipe::tied_head (native/src/kernels/tied_head_kernel.cpp) against its Python twin
in the ExecuTorch runtime, on shapes that reach every remainder path; and built programs whose embedding bytes occur
once in the file (twice with export.store_tied_once=false: the count can fail)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.model.layers.tied_head import TiedHead, rounding_bound, tied_head_int_ref, tied_head_ref
from pipeline.ops import load_native_kernels
from tests.helpers import build, stage_path


class Head(nn.Module):
    def __init__(self, q, s):
        super().__init__()
        self.head = TiedHead(q, s)

    def forward(self, x):
        return self.head(x)


@pytest.mark.parametrize("D", [83, 4133])  # 64 + 16 + 3 columns: every loop of the row; past two int32 chunks of 2048
def test_kernel_matches_its_twin(tmp_path, D):
    from executorch.exir import to_edge
    from executorch.runtime import Runtime
    torch.manual_seed(0)
    V = 37  # rows past the 4-row blocks
    q = torch.randint(-127, 128, (V, D), dtype=torch.int8)
    s = torch.rand(V, 1) * 0.02
    x = torch.randn(1, 5, D)
    ep = torch.export.export(Head(q, s), (x,), dynamic_shapes=({1: torch.export.Dim("T", max=16)},), strict=False)
    path = tmp_path / "head.pte"
    path.write_bytes(to_edge(ep).to_executorch().buffer)
    load_native_kernels()
    run = Runtime.get().load_program(str(path)).load_method("forward")
    dense = q.double() * s.double()
    for T in (5, 1):
        got = run.execute([x[:, :T]])[0]
        want = tied_head_ref(x[:, :T], q, s)
        assert got.shape == (1, T, V)
        # the kernel rounds x to int16: within that rounding's bound of the fp32 twin, and its own arithmetic's bits
        # (exact integer sums: the same on every ISA path, tests/native/test_isa_paths.py runs this on each)
        assert bool(((got - want).abs() <= rounding_bound(x[:, :T], q, s) + 1e-5).all())
        assert torch.equal(got, tied_head_int_ref(x[:, :T], q, s))
        torch.testing.assert_close(want, (x[:, :T].double() @ dense.T).float(), rtol=1e-5, atol=1e-4)


def test_twin_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="int8"):
        tied_head_ref(torch.randn(2, 8), torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match="one per row"):
        tied_head_ref(torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(3))


def _copies(manifest: dict) -> tuple[int, dict]:
    """How often the embedding's int8 values occur in the built program's file, and export's record."""
    import json
    module = torch.load(stage_path(manifest, "quantize") / "module.pt", weights_only=False)
    table = module.model.get_input_embeddings().weight.qdata.numpy().tobytes()
    pte = (stage_path(manifest, "lower") / "model.pte").read_bytes()
    return pte.count(table), json.loads((stage_path(manifest, "export") / "manifest.json").read_text())


@pytest.mark.parametrize("recipe, extra", [
    ("tiny_llama_xnnpack", ("model.random.tie_word_embeddings=true", "quantize=8da4w_mixed")),
    ("tiny_gemma3_xnnpack", ("quantize=8da4w_mixed",)),  # a scaled embedding, softcapped logits
    ("tiny_llama_offgraph", ("model.random.tie_word_embeddings=true", "quantize=8w")),
])
def test_a_tied_weight_is_stored_once(recipe, extra):
    once = build(recipe, *extra)
    n, record = _copies(once)
    assert n == 1, f"the tied embedding is stored {n} times"
    assert record["metrics"]["tied_head"] is True
    twice, _ = _copies(build(recipe, *extra, "export.store_tied_once=false"))
    assert twice == 2


def test_untied_or_4bit_heads_keep_their_own_weight():
    m = build("tiny_llama_xnnpack", "model.random.tie_word_embeddings=true", "quantize=4w", stages=(
        "download", "wrap", "quantize", "export"))
    import json
    record = json.loads((stage_path(m, "export") / "manifest.json").read_text())
    assert record["metrics"]["tied_head"] is False and "8-bit" in record["metrics"]["tied_head_why"]
