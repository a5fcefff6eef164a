"""Wrapping and quantization on tiny random Llama and Gemma 3 models (no network, seconds)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.model.cache_modes import wrap
from pipeline.model.loading import load_hf_model
from pipeline.runtimes.base import run_sequence
from pipeline.model.quant.apply import quantize_module
from pipeline.stages.wrap import self_check
from tests.helpers import build, compose_cfg


@pytest.fixture(scope="module")
def tiny_dirs():
    return {name: build(f"tiny_{name}_xnnpack", stages=("download",))["model_dir"] for name in ("llama", "gemma3")}


@pytest.mark.parametrize("name,chunk", [("llama", 16), ("gemma3", 8), ("gemma3", 1)])
def test_static_wrapper_matches_hf_forward_past_the_window(tiny_dirs, name, chunk):
    model = load_hf_model(tiny_dirs[name])
    module = wrap(model, "static", 64, "last")
    window = getattr(model.config, "sliding_window", None) if name == "gemma3" else None
    check = self_check(module, model, 64, chunk, window, model.config.vocab_size)
    if name == "gemma3":
        assert check["tokens"] > window  # the window masks are exercised
    assert check["max_abs_err"] < 1e-4


def test_full_logits_mode_returns_every_row(tiny_dirs):
    module = wrap(load_hf_model(tiny_dirs["llama"]), "static", 64, "full")
    out = module(torch.tensor([[5, 6, 7]]), torch.arange(3))
    assert out.shape[:2] == (1, 3)


def _quantized(tiny_dir, *overrides):
    cfg = compose_cfg("recipe=tiny_llama_xnnpack", *overrides)
    module = wrap(load_hf_model(tiny_dir), "static", 64, "last")
    with torch.no_grad():
        report = quantize_module(module, cfg.quantize)
    return module, report


def test_retie_when_schemes_are_equal(tiny_dirs):
    module, report = _quantized(tiny_dirs["llama"], "quantize=4w", "backend=portable")
    m = module.model
    assert report["tied_in_model"] and report["retied"]
    assert m.get_output_embeddings().weight is m.get_input_embeddings().weight


@pytest.mark.parametrize("overrides", [("quantize=8da4w",), ("quantize=4w", "quantize.tie_word_embeddings=false")])
def test_no_retie_otherwise(tiny_dirs, overrides):
    module, report = _quantized(tiny_dirs["llama"], *overrides)
    m = module.model
    assert not report["retied"]
    assert m.get_output_embeddings().weight is not m.get_input_embeddings().weight


@pytest.mark.parametrize("scheme", ["8da4w", "4w", "8w"])
def test_quantized_eager_stays_close_to_float(tiny_dirs, scheme):
    float_module = wrap(load_hf_model(tiny_dirs["llama"]), "static", 64, "last")
    ids = list(range(3, 40))
    ref = run_sequence(float_module, ids, 16)
    module, report = _quantized(tiny_dirs["llama"], f"quantize={scheme}")
    got = run_sequence(module, ids, 16)
    assert report["linear_layers"] > 0 and report["embedding_layers"] == 1
    assert not any(type(p) is nn.Parameter and p.dtype == torch.float32 and p.dim() == 2 and p.shape[0] == 128
                   for p in module.model.model.layers[0].mlp.parameters()), "linears were not quantized"
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=0)
    assert cos > 0.9, f"{scheme}: cosine {cos:.3f}"  # unrelated logits score near 0
