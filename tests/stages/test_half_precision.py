"""fp16 / bf16 builds: XNNPACK delegates their matmuls, wrap's self-check scales with the logits, the `half` gate
holds them to their numerics floor, and the off-graph cache stores the program's dtype."""
from __future__ import annotations

import pytest
import torch

from pipeline.abi import ACTIVATION_DTYPE
from pipeline.errors import ConfigError
from pipeline.exporters.native import MATMUL_OPS, LoweringRefused, delegation_report, refuse_undelegated_matmuls
from pipeline.stages import verify, wrap
from tests.helpers import build, compose_cfg


def test_bf16_on_xnnpack_delegates_every_matmul_and_passes_the_half_gate():
    m = build("tiny_llama_custom", "export.dtype=bf16")
    lower = next(s for s in m["stages"] if s["name"] == "lower")["metrics"]
    assert all(lower["delegation_by_op"][op]["non_delegated"] == 0 for op in MATMUL_OPS
               if op in lower["delegation_by_op"])
    assert lower["delegation_by_op"]["aten_linear_default"]["delegated"] > 0
    s = m["verify"]
    assert s["gate"] == "half" and s["floor"]["kld"] > 0
    assert s["same_quant"]["kld"] <= 1.5 * s["floor"]["kld"] + 1e-4 and s["same_quant"]["top1"] == 1.0
    assert s["native"]["token_parity"]


def test_fp16_off_graph_cache_stores_half():
    m = build("tiny_llama_offgraph", "export.dtype=fp16")
    s = m["verify"]
    assert s["gate"] == "half" and s["native"]["token_parity"]
    assert "kv_dtype=Half" in s["native"]["cache_report"]


def _tiny_bf16_linear_program():
    from executorch.exir import to_edge_transform_and_lower
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from pipeline.backends.xnnpack.weight_only import partitioner
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16).eval()
    ep = torch.export.export(lin, (torch.randn(4, 64, dtype=torch.bfloat16),))
    stock = delegation_report(to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]))
    ours = delegation_report(to_edge_transform_and_lower(ep, partitioner=[partitioner()]))
    return stock, ours


def test_a_bf16_matmul_outside_the_delegate_is_refused():
    stock, ours = _tiny_bf16_linear_program()
    with pytest.raises(LoweringRefused, match="export.dtype=bf16: 1 matmuls fell outside the xnnpack delegate"):
        refuse_undelegated_matmuls(stock, "bf16", "xnnpack")   # the stock partitioner leaves it on portable
    refuse_undelegated_matmuls(ours, "bf16", "xnnpack")        # ours delegates it
    refuse_undelegated_matmuls(stock, "fp32", "xnnpack")       # fp32 linears outside are quantize's warning


def test_the_transformers_route_refuses_bf16_on_xnnpack_before_any_work():
    from pipeline.preflight import check as check_config
    with pytest.raises(ConfigError, match=r"export.dtype='bf16'.*allowed: \['fp32', 'fp16'\].*stock XNNPACK"):
        check_config(compose_cfg("recipe=tiny_llama_hf_exporter", "export.dtype=bf16"))
    check_config(compose_cfg("recipe=tiny_llama_hf_exporter_mlx", "export.dtype=bf16"))


def test_fp16_group_wise_weight_only_runs_on_the_portable_mixed_linear():
    """Its scales follow the activations: with fp32 scales the kernel failed at run time (error 0x12). The tiny random
    model's own fp16 rounding moves its flat logits off the float model's argmax, so only same-quant is gated."""
    m = build("tiny_llama_xnnpack_4w", "export.dtype=fp16", "verify.half.vs_float.min_top1=null")
    lower = next(s for s in m["stages"] if s["name"] == "lower")["metrics"]
    assert lower["delegation_by_op"]["quantized_decomposed_mixed_linear_default"]["non_delegated"] > 0
    s = m["verify"]
    assert s["gate"] == "half" and s["same_quant"]["top1"] == 1.0 and s["native"]["token_parity"]


@pytest.mark.parametrize("recipe,dtype,group,why", [
    ("tiny_llama_xnnpack_4w", "bf16", 32, "mixed_linear kernel, which has no bf16 form"),
    ("tiny_llama_xnnpack_4w", "fp16", 0, "per-channel weight-only linears .* take fp32 activations only"),
    ("tiny_llama_xnnpack_8w", "fp16", 0, "per-channel weight-only linears .* take fp32 activations only"),
    ("tiny_llama_xnnpack_8w", "bf16", 32, "mixed_linear kernel, which has no bf16 form"),
])
def test_weight_only_linears_xnnpack_cannot_run_at_half_are_refused_before_any_work(recipe, dtype, group, why):
    from pipeline.preflight import check as check_config
    with pytest.raises(ConfigError, match=rf"quantize.linear.*export.dtype={dtype}: .*{why}"):
        check_config(compose_cfg(f"recipe={recipe}", f"export.dtype={dtype}", f"quantize.linear_group_size={group}"))


@pytest.mark.parametrize("dtype,quantize,gate", [("fp32", "none", "exact"), ("bf16", "none", "half"),
                                                 ("fp16", "4w", "half"), ("bf16", "8da4w", "dynamic")])
def test_the_auto_gate_follows_dtype_and_scheme(dtype, quantize, gate):
    assert verify.gate_of(compose_cfg(f"export.dtype={dtype}", f"quantize={quantize}")) == gate


def test_self_check_tolerance_scales_with_the_logits():
    assert wrap.SELF_CHECK_TOL["fp32"] < wrap.SELF_CHECK_TOL["fp16"] < wrap.SELF_CHECK_TOL["bf16"]
    # bf16 rounds at 2^-8: its bound sits above one rounding of the largest logit, and far below a wrong wrapper
    assert 2 ** -8 < wrap.SELF_CHECK_TOL["bf16"] < 0.1


def test_bf16_int4_on_mlx_sits_within_its_floor():
    """MLX's affine weights (bias rounded to bf16) and fp32 accumulation are what the reference computes: before
    pipeline/backends/mlx/numerics.py this build sat at 3.3x its floor."""
    s = build("tiny_llama_mlx_int4", "export.dtype=bf16")["verify"]
    assert s["gate"] == "half"
    assert s["same_quant"]["kld"] < s["floor"]["kld"]
