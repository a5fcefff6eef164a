"""GPTQ (pipeline/model/quant/gptq.py) and the target-bits allocator (pipeline/model/quant/allocate.py): eager, on
synthetic weights and a tiny random Llama, in seconds."""
from __future__ import annotations

import json

import pytest
import torch

from pipeline.backends import BACKENDS
from pipeline.model.quant.allocate import allocate, file_bits, overrides, snippet
from pipeline.model.quant.gptq import gptq, hessians
from pipeline.model.layers.exportable import make_exportable
from pipeline.model.loading import load_hf_model
from tests.helpers import build, stage_path


def _round_to_nearest(w: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    qmax = (1 << (bits - 1)) - 1
    g = w.reshape(w.shape[0], -1, group)
    s = g.abs().amax(-1, keepdim=True) / (qmax + 0.5)
    return (torch.clamp(torch.round(g / s), -qmax - 1, qmax) * s).reshape(w.shape)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 0)])
def test_gptq_loses_less_on_the_calibration_inputs_than_rounding(bits, group):
    torch.manual_seed(0)
    mix = torch.randn(128, 128) / 8 + torch.eye(128)  # correlated inputs, as a layer's are
    x = torch.randn(2048, 128) @ mix
    w = torch.randn(64, 128)
    q, s = gptq(w, x.T @ x / len(x), bits, group, bf16_scales=bits == 4)
    g = group or 128
    deq = (q.float().reshape(64, -1, g) * s[:, :, None]).reshape(64, 128)
    assert q.dtype == torch.int8 and int(q.min()) >= -(1 << (bits - 1)) and int(q.max()) < (1 << (bits - 1))
    if bits == 4:
        assert torch.equal(s, s.to(torch.bfloat16).float())  # XNNPACK's group scales are bf16
    ours = (x @ (w - deq).T).norm()
    nearest = (x @ (w - _round_to_nearest(w, bits, g)).T).norm()
    assert ours < 0.9 * nearest, (float(ours), float(nearest))


def test_linears_reading_one_input_share_one_hessian():
    m = build("tiny_llama_xnnpack", stages=("download",))
    model = load_hf_model(m["model_dir"])
    make_exportable(model)
    h = hessians(model, [list(range(1, 40)), list(range(50, 90))])
    attn = "model.layers.0.self_attn"
    assert h[f"{attn}.q_proj"] is h[f"{attn}.k_proj"] is h[f"{attn}.v_proj"]
    assert h[f"{attn}.o_proj"] is not h[f"{attn}.q_proj"]
    assert h["model.layers.1.mlp.gate_proj"] is h["model.layers.1.mlp.up_proj"]
    assert h["model.layers.1.mlp.down_proj"].shape == (128, 128)
    assert torch.allclose(h[f"{attn}.q_proj"], h[f"{attn}.q_proj"].T)


def test_the_allocator_buys_the_most_kld_per_bit_within_the_target():
    shapes = {"a": (10, 64), "b": (10, 64), "c": (10, 64)}
    costs = {"a": {"8da4w g32": 0.10, "8da8w g0": 0.01},   # saves 0.09
             "b": {"8da4w g32": 0.02, "8da8w g0": 0.01},   # saves 0.01
             "c": {"8da4w g32": 0.05, "8da8w g0": 0.00}}   # saves 0.05
    four, eight = (file_bits(s, g, 64, BACKENDS["xnnpack"]) * 640 for s, g in (("8da4w", 32), ("8da8w", 0)))
    params = 3 * 640
    # room for exactly one upgrade: a's
    plan = allocate(costs, shapes, 0.0, params, (3 * four + (eight - four) * 1.5) / params, BACKENDS["xnnpack"])
    assert {n: p["scheme"] for n, p in plan["linears"].items()} == {"a": "8da8w", "b": "8da4w", "c": "8da4w"}
    assert plan["predicted_kld"] == pytest.approx(0.01 + 0.02 + 0.05)
    assert plan["predicted_bpw"] <= plan["target_bpw"]
    assert overrides(plan, ("8da4w", 32)) == [{"pattern": "a", "scheme": "8da8w", "group_size": 0}]
    assert "pattern: 'a', scheme: 8da8w" in snippet(plan, ("8da4w", 32))
    everything = allocate(costs, shapes, 0.0, params, 9.0, BACKENDS["xnnpack"])
    assert everything["by_scheme"] == {"8da8w g0": 3}
    with pytest.raises(ValueError, match="target_bpw=3.0"):
        allocate(costs, shapes, 0.0, params, 3.0, BACKENDS["xnnpack"])


def test_a_target_build_records_its_plan_and_builds_it():
    m = build("tiny_llama_xnnpack_8da4w", "quantize.target_bpw=6.0", stages=("quantize",))
    report = json.loads((stage_path(m, "quantize") / "quantize.json").read_text())
    plan = report["plan"]
    assert plan["target_bpw"] == 6.0 and plan["predicted_bpw"] <= 6.0 and len(plan["linears"]) == 14
    assert sum(plan["by_scheme"].values()) == 14
    built = {k: n for k, n in report["by_scheme"].items()}
    assert built.get("8da8w g0", 0) == plan["by_scheme"].get("8da8w g0", 0)
    calibration = json.loads((stage_path(m, "calibrate") / "calibration.json").read_text())
    assert calibration["sensitivity_linears"] == 14


def test_a_trial_replays_the_layers_before_its_linear_exactly():
    """The sensitivity pass replays the float outputs of the layers before a linear's own: the same KLD as a whole
    forward with that linear quantized."""
    from pipeline.model.quant.allocate import _kld, sensitivities, trial_ids
    from pipeline.model.quant.apply import quantize_one, torchao_config
    m = build("tiny_llama_xnnpack", stages=("download",))
    model = load_hf_model(m["model_dir"])
    make_exportable(model)
    seqs = [list(range(1, 200)), list(range(200, 400))]
    name = "model.layers.1.mlp.up_proj"
    got = sensitivities(model, seqs, [name], [("8da4w", 32)], "minmax")[name]["8da4w g32"]
    ids = trial_ids(seqs)
    assert ids.shape == (2, 64)  # a row of each: both weigh in
    keep = torch.arange(ids.shape[1] // 2, ids.shape[1])
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits, -1)
        quantize_one(model, name, torchao_config("8da4w", 32, "minmax"))
        want = _kld(ref, model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits)
    assert got > 0 and got == pytest.approx(want, rel=1e-4)
