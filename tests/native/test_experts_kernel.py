"""llmpipe::experts (native/src/kernels/experts_kernel.cpp) against its Python twin (pipeline/model/layers/experts.py
experts_ref), bit for bit, in the ExecuTorch runtime: every weight form (fp32, 4-bit values two a byte and 8-bit ones,
in groups or per channel, with torchao's dynamic int8 activations or without), the three activations (Nemotron-H's
ungated relu^2: no gate, its arguments up's own buffers), biases, a single decode row and an expert no row picked;
and the twin against the eager experts it packs (torchao's linears) within float rounding."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.model.layers.experts import Expert, ExpertBank, PackedExperts
from pipeline.ops import load_native_kernels

H, I, E, K = 64, 96, 8, 2


def quantize(bank: nn.Module, scheme: str) -> None:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup
    config = {"8da4w": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)),
              "8da8w": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
              "4w": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
              "8w": IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))}.get(scheme)
    if config is not None:
        quantize_(bank, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear))


def program(packed: nn.Module, x, idx, w, tmp_path):
    from executorch.exir import to_edge
    from executorch.runtime import Runtime
    n = torch.export.Dim("n", max=64)
    ep = torch.export.export(packed, (x, idx, w), strict=False,
                             dynamic_shapes={"hidden": {0: n}, "top_k_index": {0: n}, "top_k_weights": {0: n}})
    path = tmp_path / "experts.pte"
    path.write_bytes(to_edge(ep).to_executorch().buffer)
    load_native_kernels()
    return Runtime.get().load_program(str(path)).load_method("forward")


@pytest.mark.parametrize("scheme", ["none", "8da4w", "8da8w", "4w", "8w"])
@pytest.mark.parametrize("activation", ["silu", "clamped_swiglu", "relu2"])
def test_kernel_equals_its_twin_bit_for_bit(scheme, activation, tmp_path):
    torch.manual_seed(0)
    bank = ExpertBank([Expert(H, I, activation == "clamped_swiglu", activation, nn.SiLU(), 7.0, 1.702)
                       for _ in range(E)]).eval()
    quantize(bank, scheme)
    packed = PackedExperts(bank).eval()
    assert packed.up_w.dtype == {"none": torch.float32, "8da8w": torch.int8, "8w": torch.int8}.get(scheme, torch.uint8)
    assert hasattr(packed, "gate_w") != (activation == "relu2")  # ungated: no gate weights stored
    rows = torch.randn(9, H) * 3
    picks = torch.stack([torch.randperm(E - 1)[:K] for _ in range(9)])  # expert E - 1: no row picks it
    weights = torch.softmax(torch.randn(9, K), -1)
    run = program(packed, rows, picks, weights, tmp_path)
    with torch.no_grad():
        for n in (9, 1):  # a prefill chunk, a decode row
            x, idx, w = rows[:n], picks[:n], weights[:n]
            twin = packed(x, idx, w)
            assert torch.equal(run.execute([x, idx, w])[0], twin), (scheme, activation, n)
            eager = bank(x, idx, w)
            assert (twin - eager).abs().max() <= 1e-5 * eager.abs().max(), (scheme, activation, n)


def test_bad_inputs_fail_clearly(tmp_path):
    bank = ExpertBank([Expert(H, I, False, "silu", nn.SiLU()) for _ in range(E)]).eval()
    packed = PackedExperts(bank).eval()
    x, idx, w = torch.randn(3, H), torch.zeros(3, K, dtype=torch.long), torch.full((3, K), 0.5)
    run = program(packed, x, idx, w, tmp_path)
    with pytest.raises(RuntimeError):
        run.execute([x, torch.full((3, K), E, dtype=torch.long), w])  # an expert index past the bank
