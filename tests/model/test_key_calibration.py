"""Calibrated keys (cache.calibrate_keys, pipeline/model/layers/key_calibration.py): the cache storing (k - m) * a and
attention taking q / a leaves the function as it was at float storage (KV-shared layers included), and brings int4
rows closer to HF's float forward when the keys share a large offset; where it is on by default, and the builds that
refuse it."""
from __future__ import annotations

import pytest
import torch

from pipeline import abi, preflight
from pipeline.errors import ConfigError
from pipeline.model import archs
from pipeline.model.cache_modes import wrap
from pipeline.model.geometry import from_config
from pipeline.model.layers import key_calibration
from pipeline.model.layers.exportable import make_exportable
from pipeline.stages.wrap import calibrate_keys, compare, hf_reference
from tests.helpers import compose_cfg
from tests.model.test_archs import tiny_model

CONTEXT = 64


def offset_model():
    """A tiny Qwen2 (keys with a bias) whose key bias is pushed far from zero: every key shares a large offset, as
    real models' keys do (Gemma 3's global layers: a mean key of norm ~100)."""
    model = tiny_model("qwen2")
    gen = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        bias = layer.self_attn.k_proj.bias.data.unflatten(0, (-1, layer.self_attn.head_dim))
        half = bias.shape[1] // 2
        # RoPE's slowest pairs (the last of each half) barely turn over the context, so the offset survives it
        for d in (half - 2, half - 1, 2 * half - 2, 2 * half - 1):
            bias[:, d] += 30 * torch.randn(bias.shape[0], generator=gen)
    return model


def wrapped_error(model, mode: str, storage: str, calibrated: bool) -> float:
    """Max |logit - HF float| of the wrapped module over prefill + decode past the window (wrap's self-check)."""
    g = from_config(model.config.get_text_config())
    chunk = min(8, g.smallest_window or 8)
    with torch.no_grad():
        reference = hf_reference(model, CONTEXT, chunk, g.sliding_window, g.vocab_size)
        make_exportable(model)
        gen = torch.Generator().manual_seed(2)
        stats = key_calibration.measure(model, [torch.randint(3, g.vocab_size, (24,), generator=gen).tolist()
                                                for _ in range(4)], CONTEXT) if calibrated else {}
        dtype = abi.KV_DTYPES[storage]
        module = wrap(model, mode, CONTEXT, "last", chunk, kv_dtype=dtype if mode == "custom" else None)
        if mode == "offgraph":  # the runtime picks the storage, as verify's eager reference does
            module.cache.store_as(dtype)
        key_calibration.install(stats, torch.float32)
        return compare(module, reference, chunk)["max_abs_err"]


@pytest.mark.parametrize("mode", ["custom", "offgraph"])
@pytest.mark.parametrize("model_type", ["qwen2", "gemma4_text"])
def test_calibrated_keys_keep_the_function(model_type, mode):
    """At fp32 storage the calibrated wrapper is HF's forward: each query's scores all move by q . m, and a is a power
    of two. Gemma 4's KV-shared layers read their source's transformed rows with their source's 1 / a."""
    assert wrapped_error(tiny_model(model_type), mode, "fp32", True) < 1e-4


@pytest.mark.parametrize("mode", ["custom", "offgraph"])
def test_calibrated_int4_rows_sit_nearer_float(mode):
    plain = wrapped_error(offset_model(), mode, "int4", False)
    calibrated = wrapped_error(offset_model(), mode, "int4", True)
    assert calibrated < 0.5 * plain, (plain, calibrated)


def test_the_transform_keeps_every_score_up_to_its_querys_constant():
    gen = torch.Generator().manual_seed(3)
    stats = {"k": torch.randn(2, 16, generator=gen).double() * 40, "k2": 0, "n": 10, "group": 3,
             "q2": torch.rand(2, 16, generator=gen).double() * 100}
    stats["k2"] = (stats["k"] / 10) ** 2 * 10 + torch.rand(2, 16, generator=gen).double() * 50
    mean, a = key_calibration.transform(stats, [stats])
    assert torch.equal(torch.exp2(torch.log2(a).round()), a) and a.min() > 0  # powers of two
    m = torch.nn.Module()
    m.register_buffer("k_mean", mean[:, None])
    m.register_buffer("k_mul", a[:, None])
    m.register_buffer("q_mul", (1 / a).repeat_interleave(3, 0)[:, None])
    q, k = torch.randn(1, 6, 5, 16, generator=gen), torch.randn(1, 2, 7, 16, generator=gen) * 10 + mean[None, :, None]
    got = key_calibration.queries_in(m, q) @ key_calibration.keys_in(m, k).repeat_interleave(3, 1).transpose(-1, -2)
    want = q @ (k - mean[None, :, None]).repeat_interleave(3, 1).transpose(-1, -2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_the_statistics_are_of_the_keys_after_rope():
    """measure() sums the keys HF's attention receives (after RoPE), one [Hkv, D] per layer."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    model = offset_model()
    with torch.no_grad():
        ids = list(range(3, 35))
        stats = key_calibration.measure(model, [ids])
        attn = model.model.layers[0].self_attn
        h = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor([ids])))
        k = attn.k_proj(h).view(1, len(ids), -1, attn.head_dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(h, torch.arange(len(ids))[None])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
    s = stats[attn]
    assert s["n"] == len(ids) and s["group"] == model.config.num_attention_heads // model.config.num_key_value_heads
    torch.testing.assert_close((s["k"] / s["n"]).float(), k[0].mean(1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides,expected", [
    ([], False),                                                        # the default: custom cache, fp16 K/V
    (["cache.kv_dtype=int4"], True),
    (["cache=offgraph"], True),                                         # the runtime may store int4
    (["cache=offgraph", "cache.calibrate_keys=false"], False),
    (["backend=mlx", "cache=offgraph", "quantize=none"], False),        # MLX's runtime stores floats
    (["cache=static"], False),
])
def test_where_keys_are_calibrated_by_default(overrides, expected):
    cfg = compose_cfg(*overrides)
    assert calibrate_keys(cfg, archs.lookup("llama")) is expected


@pytest.mark.parametrize("overrides,words", [
    (["cache=static", "cache.calibrate_keys=true"], ["cache.calibrate_keys", "cache.mode=static", "offgraph"]),
    (["backend=mlx", "cache=offgraph", "quantize=none", "cache.calibrate_keys=true"],
     ["cache.calibrate_keys", "backend=mlx", "float type"]),
])
def test_calibrate_keys_where_it_cannot_be_built_is_refused(overrides, words):
    with pytest.raises(ConfigError) as e:
        preflight.check(compose_cfg(*overrides))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_sink_logits_refuse_calibrated_keys():
    assert key_calibration.refused(archs.lookup("gpt_oss")) and not key_calibration.refused(archs.lookup("llama"))
    assert not calibrate_keys(compose_cfg("cache=offgraph"), archs.lookup("gpt_oss"))
