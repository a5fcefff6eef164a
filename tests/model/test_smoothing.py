"""quantize.smoothing on tiny random models (eager, seconds): the float model computes the same function
after smoothing (Llama's norms scale by w, Gemma's by 1 + w), and a model with an activation outlier channel
loses less to 8da4w with it than without."""
from __future__ import annotations

import pytest
import torch

from pipeline.model.cache_modes import wrap
from pipeline.model.loading import load_hf_model
from pipeline.model.quant.apply import quantize_module
from pipeline.model.quant.smoothing import activation_maxima, smooth
from pipeline.preflight import ConfigError, check
from tests.helpers import build, compose_cfg


def _model(recipe):
    return load_hf_model(build(recipe, stages=("download",))["model_dir"])


def _sequences(model, n=3, length=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (length,), generator=g).tolist() for _ in range(n)]


@torch.no_grad()
def _logits(model, ids):
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


@pytest.mark.parametrize("recipe", ["tiny_llama_xnnpack", "tiny_gemma3_xnnpack"])
def test_smoothing_keeps_the_float_function(recipe):
    model, original = _model(recipe), _model(recipe)
    seqs = _sequences(model)
    n = smooth(model, activation_maxima(model, seqs), 0.5)
    assert n == 7 * model.config.get_text_config().num_hidden_layers
    layer, before = model.model.layers[0], original.model.layers[0]
    assert not torch.equal(layer.input_layernorm.weight, before.input_layernorm.weight)
    assert not torch.equal(layer.self_attn.o_proj.weight, before.self_attn.o_proj.weight)
    for ids in seqs:
        want, got = _logits(original, ids), _logits(model, ids)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("recipe", ["tiny_llama_xnnpack", "tiny_gemma3_xnnpack"])
def test_one_pass_gives_the_smoothed_models_hessians(recipe):
    """The calibrate stage measures maxima and Hessians in one pass and rescales the Hessians by smoothing's divisors:
    the Hessians of the smoothed model, measured after it (a second pass), up to rounding."""
    from pipeline.model.quant.gptq import hessians, rescaled
    from pipeline.stages.calibrate import measure
    one, two = _model(recipe), _model(recipe)
    seqs = _sequences(one)
    with torch.no_grad():
        maxima, h = measure(one, seqs, maxima=True, hessians=True)
    scales = {}
    smooth(one, maxima, 0.5, scales)
    got = rescaled(h, scales)
    smooth(two, activation_maxima(two, seqs), 0.5)
    want = hessians(two, seqs)
    assert len(scales) == 7 * one.config.get_text_config().num_hidden_layers
    assert got.keys() == want.keys() and len(got) > len(scales)  # the head's input is not smoothed
    for key in want:
        assert (got[key] - want[key]).abs().max() <= 1e-4 * want[key].abs().max(), key
    assert got["model.layers.0.self_attn.q_proj"] is got["model.layers.0.self_attn.v_proj"]  # one input, one tensor
    # the pass skips the head's product (nothing reads its logits) and gives the head back whole
    assert "forward" not in one.get_output_embeddings().__dict__
    assert _logits(one, seqs[0]).shape[-1] == one.config.get_text_config().vocab_size
    assert not torch.allclose(got["model.layers.0.mlp.down_proj"], h["model.layers.0.mlp.down_proj"])


@torch.no_grad()
def _with_outlier(model, channel=3, factor=100.0):
    """The same function, with one hidden channel of every q/k/v input 100x larger (and its weight columns 100x
    smaller): the activation outlier real models have."""
    for layer in model.model.layers:
        layer.input_layernorm.weight[channel] *= factor
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            lin.weight[:, channel] /= factor
    return model


@torch.no_grad()
def _quantized_error(model, seqs, smoothing):
    reference = [_logits(model, ids) for ids in seqs]
    if smoothing:
        smooth(model, activation_maxima(model, seqs), 0.5)
    module = wrap(model, "static", 64, "last")
    quantize_module(module, compose_cfg("recipe=tiny_llama_xnnpack", "quantize=8da4w").quantize)
    return sum(float((_logits(module.model, ids) - r).pow(2).mean()) for ids, r in zip(seqs, reference))


def test_smoothing_recovers_what_an_outlier_channel_costs_8da4w():
    seqs = _sequences(_model("tiny_llama_xnnpack"))
    without = _quantized_error(_model("tiny_llama_xnnpack"), seqs, smoothing=False)
    plain = _quantized_error(_with_outlier(_model("tiny_llama_xnnpack")), seqs, smoothing=False)
    smoothed = _quantized_error(_with_outlier(_model("tiny_llama_xnnpack")), seqs, smoothing=True)
    assert plain > 1.2 * without                                  # the outlier costs 8da4w
    assert smoothed - without < 0.5 * (plain - without), (without, plain, smoothed)


@pytest.mark.parametrize("overrides, needle", [
    (["quantize.smoothing=1.5"], "allowed 0 < alpha < 1"),
    (["quantize.smoothing=0.5", "quantize.source_grid=true", "model=smollm2"], "choose one of the two"),
    (["quantize.smoothing=0.5", "quantize=none"], "none are quantized"),
])
def test_bad_smoothing_is_one_clear_message(overrides, needle):
    with pytest.raises(ConfigError, match="quantize.smoothing") as e:
        check(compose_cfg("recipe=tiny_llama_xnnpack", "quantize=8da4w", *overrides))
    assert needle in str(e.value)


def test_a_smoothed_build_records_its_calibration():
    m = build("tiny_llama_xnnpack_8da4w", "quantize.smoothing=0.5", stages=("download", "wrap", "quantize"))
    import json
    from tests.helpers import stage_path
    report = json.loads((stage_path(m, "quantize") / "quantize.json").read_text())
    assert report["smoothing"]["alpha"] == 0.5 and report["smoothing"]["linears"] > 0
    calibration = json.loads((stage_path(m, "calibrate") / "calibration.json").read_text())
    assert calibration["smoothing"] == 0.5 and calibration["calibration_tokens"] > 0 and calibration["hessians"] == 0
