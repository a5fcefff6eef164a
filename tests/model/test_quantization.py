"""The quantization knobs on a tiny random Llama (eager, seconds): the lm_head's own scheme, per-module overrides by
name, the algorithm, 8da8w; and the gate each build gets."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.model.cache_modes import wrap
from pipeline.model.loading import load_hf_model
from pipeline.model.quant.apply import linear_plan, quantize_module
from pipeline.model.quant.resolve import dynamic_activations
from pipeline.runtimes.base import run_sequence
from pipeline.stages.verify import gate_of
from tests.helpers import build, compose_cfg

DOWN = "+quantize.overrides=[{pattern:'*.mlp.down_proj',scheme:8da8w,group_size:0}]"


@pytest.fixture(scope="module")
def tiny_dir():
    return build("tiny_llama_xnnpack", stages=("download",))["model_dir"]


def _quantized(tiny_dir, *overrides):
    cfg = compose_cfg("recipe=tiny_llama_xnnpack", *overrides)
    module = wrap(load_hf_model(tiny_dir), "static", 64, "last")
    with torch.no_grad():
        report = quantize_module(module, cfg.quantize)
    return module, report


def test_lm_head_takes_its_own_scheme(tiny_dir):
    module, report = _quantized(tiny_dir, "quantize=8da4w", "quantize.lm_head=8da8w")
    m = module.model
    assert report["lm_head"] == "8da8w" and not report["retied"]
    assert report["by_scheme"] == {"8da4w g32": 14, "8da8w g0": 1}
    assert m.lm_head.weight.qdata.shape == m.lm_head.weight.shape
    assert m.lm_head.weight.block_size[1] == m.lm_head.in_features  # per output channel
    assert m.model.layers[0].mlp.down_proj.weight.block_size[1] == 32


def test_overrides_by_name_come_before_the_linear_scheme(tiny_dir):
    module, report = _quantized(tiny_dir, "quantize=8da4w", DOWN)
    m = module.model
    assert report["by_scheme"] == {"8da8w g0": 2, "8da4w g32": 13}
    for layer in m.model.layers:
        assert layer.mlp.down_proj.weight.block_size[1] == layer.mlp.down_proj.in_features
        assert layer.mlp.up_proj.weight.block_size[1] == 32


def test_hqq_fits_the_groups_better_than_minmax(tiny_dir):
    """HQQ's scales lower the weight error of the same 4-bit grid (measured on every linear of the model)."""
    float_module = wrap(load_hf_model(tiny_dir), "static", 64, "last")
    ref = {n: m.weight.detach().clone() for n, m in float_module.model.named_modules() if isinstance(m, nn.Linear)}

    def error(algorithm):
        module, _ = _quantized(tiny_dir, "quantize=4w", "quantize.linear_group_size=32", f"quantize.algorithm={algorithm}",
                               "quantize.tie_word_embeddings=false")
        return sum(((m.weight.dequantize() - ref[n]) ** 2).sum().item()
                   for n, m in module.model.named_modules() if isinstance(m, nn.Linear))
    assert error("hqq") < error("minmax")


def test_8da8w_stays_closer_to_float_than_8da4w(tiny_dir):
    float_module = wrap(load_hf_model(tiny_dir), "static", 64, "last")
    ids = list(range(3, 40))
    ref = run_sequence(float_module, ids, 16)
    errs = {}
    for scheme in ("8da8w", "8da4w"):
        module, _ = _quantized(tiny_dir, f"quantize.linear={scheme}", "quantize.linear_group_size=0")
        errs[scheme] = (run_sequence(module, ids, 16) - ref).abs().max().item()
    assert errs["8da8w"] < errs["8da4w"] / 4, errs


def test_the_retie_follows_the_head_scheme(tiny_dir):
    _, report = _quantized(tiny_dir, "quantize=4w", "backend=portable")
    assert report["retied"]
    _, report = _quantized(tiny_dir, "quantize=4w", "backend=portable", "quantize.lm_head=8w")
    assert not report["retied"] and report["by_scheme"]["8w g0"] == 1


@pytest.mark.parametrize("overrides,gate", [
    ((), "dynamic"),                                          # the default: 8da4w
    (("quantize=none",), "exact"),
    (("quantize=4w",), "exact"),
    (("quantize=4w", DOWN), "dynamic"),                      # one dynamic part makes the build dynamic
    (("quantize=none", "quantize.lm_head=8da8w"), "dynamic"),
    (("quantize=8da4w", "verify.gate=exact"), "exact"),      # forced
])
def test_the_gate_follows_the_scheme(overrides, gate):
    cfg = compose_cfg(*overrides)
    assert gate_of(cfg) == gate
    assert dynamic_activations(cfg.quantize) == (gate == "dynamic" or "verify.gate=exact" in overrides)


def test_plan_names_every_linear_once(tiny_dir):
    cfg = compose_cfg("recipe=tiny_llama_xnnpack", "quantize=8da4w", DOWN, "quantize.lm_head=8da8w")
    model = load_hf_model(tiny_dir)
    plan = linear_plan(model, cfg.quantize, retie=False)
    names = [n for group in plan.values() for n in group]
    assert sorted(names) == sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("scheme,group,algorithm", [("4w", 32, "minmax"), ("8da4w", 32, "minmax"), ("8w", 0, "minmax"),
                                                    ("8da8w", 0, "minmax"), ("4w", 32, "hqq")])
def test_large_weights_quantized_in_row_slices_equal_one_piece(monkeypatch, scheme, group, algorithm):
    """quantize_one slices a weight above CHUNK_ELEMENTS by rows (no float temporaries of the whole weight): the
    same torchao tensor, field for field, and the same outputs, as quantizing it whole."""
    from torchao.quantization import quantize_

    from pipeline.model.quant import apply
    torch.manual_seed(0)
    sliced, whole = nn.Module(), nn.Module()
    for m in (sliced, whole):
        m.embed, m.proj = nn.Embedding(1000, 64), nn.Linear(64, 1500, bias=True)
    whole.load_state_dict(sliced.state_dict())
    monkeypatch.setattr(apply, "CHUNK_ELEMENTS", 64 * 96)  # slices of 96 rows, the last one short
    slices, same_kind = [], apply._same_kind
    monkeypatch.setattr(apply, "_same_kind", lambda m, w: slices.append(w.shape[0]) or same_kind(m, w))
    config = apply.torchao_config(scheme, group, algorithm)
    embed_config = apply.torchao_config("8w" if scheme.startswith("8") else "4w", group, algorithm)
    for name, c in (("embed", embed_config), ("proj", config)):
        apply.quantize_one(sliced, name, c)
        quantize_(whole, c, filter_fn=lambda m, fqn: fqn == name)
    assert slices == [96] * 10 + [40] + [96] * 15 + [60]
    for name in ("embed", "proj"):
        a, b = getattr(sliced, name).weight, getattr(whole, name).weight
        assert type(a) is type(b) and a.block_size == b.block_size and a.activation_quantization == b.activation_quantization
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("qdata", "scale", "zero_point"))
    ids, x = torch.randint(0, 1000, (7,)), torch.randn(3, 64)
    assert torch.equal(sliced.embed(ids), whole.embed(ids)) and torch.equal(sliced.proj(x), whole.proj(x))


def test_a_layout_that_is_not_row_local_is_quantized_whole_after_one_slice(monkeypatch):
    """nvfp4's tensor is not torchao's int8-unpacked layout: the first slice shows it, the weight is quantized whole."""
    from torchao.quantization import quantize_

    from pipeline.model.quant import apply
    torch.manual_seed(0)
    sliced, whole = nn.Module(), nn.Module()
    for m in (sliced, whole):
        m.proj = nn.Linear(64, 1504, bias=False)
    whole.load_state_dict(sliced.state_dict())
    monkeypatch.setattr(apply, "CHUNK_ELEMENTS", 64 * 96)
    slices, same_kind = [], apply._same_kind
    monkeypatch.setattr(apply, "_same_kind", lambda m, w: slices.append(w.shape[0]) or same_kind(m, w))
    config = apply.torchao_config("nvfp4", 16)
    apply.quantize_one(sliced, "proj", config)
    quantize_(whole, config, filter_fn=lambda m, fqn: fqn == "proj")
    assert slices == [96] and type(sliced.proj.weight) is type(whole.proj.weight)
    x = torch.randn(3, 64)
    assert torch.equal(sliced.proj(x), whole.proj(x))
