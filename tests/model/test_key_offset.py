"""Centred keys (cache.center_keys, pipeline/model/kv/key_offset.py): each layer's mean key subtracted before the cache
stores it leaves the function as it was at float storage, and brings int4 rows closer to HF's float forward when the
keys share a large offset; where it is on by default, and the builds that refuse it."""
from __future__ import annotations

import pytest
import torch

from pipeline import abi, preflight
from pipeline.errors import ConfigError
from pipeline.model import archs
from pipeline.model.cache_modes import wrap
from pipeline.model.geometry import from_config
from pipeline.model.kv import key_offset
from pipeline.model.layers.exportable import make_exportable
from pipeline.stages.wrap import center_keys, compare, hf_reference
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


def wrapped_error(mode: str, storage: str, centre: bool) -> float:
    """Max |logit - HF float| of the wrapped module over prefill + decode (wrap's own self-check)."""
    model = offset_model()
    g = from_config(model.config.get_text_config())
    chunk = 8
    with torch.no_grad():
        ids, kept, prefill = hf_reference(model, CONTEXT, chunk, g.sliding_window, g.vocab_size)
        make_exportable(model)
        gen = torch.Generator().manual_seed(2)
        means = key_offset.measure(model, [torch.randint(3, g.vocab_size, (48,), generator=gen).tolist()
                                           for _ in range(4)]) if centre else {}
        dtype = abi.KV_DTYPES[storage]
        module = wrap(model, mode, CONTEXT, "last", chunk, kv_dtype=dtype if mode == "custom" else None)
        if mode == "offgraph":  # the runtime picks the storage, as verify's eager reference does
            module.cache.store_as(dtype)
        key_offset.install(means, torch.float32)
        return compare(module, ids, kept, prefill, chunk)["max_abs_err"]


@pytest.mark.parametrize("mode", ["custom", "offgraph"])
def test_centred_keys_keep_the_function_and_int4_rows_nearer_float(mode):
    # fp32 storage: the softmax sees every score of a query moved by the same amount
    assert wrapped_error(mode, "fp32", True) < 1e-4
    plain, centred = wrapped_error(mode, "int4", False), wrapped_error(mode, "int4", True)
    assert centred < 0.5 * plain, (plain, centred)


def test_the_mean_is_the_keys_mean_after_rope():
    """measure() averages the keys HF's attention receives (after RoPE), one [Hkv, D] per layer."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    model = offset_model()
    with torch.no_grad():
        ids = list(range(3, 35))
        means = key_offset.measure(model, [ids])
        # HF's own eager attention receives the same keys: recompute layer 0's
        attn = model.model.layers[0].self_attn
        h = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor([ids])))
        k = attn.k_proj(h).view(1, len(ids), -1, attn.head_dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(h, torch.arange(len(ids))[None])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
    assert means[attn].shape == (model.config.num_key_value_heads, attn.head_dim)
    torch.testing.assert_close(means[attn], k[0].mean(1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides,expected", [
    ([], False),                                                        # the default: custom cache, fp16 K/V
    (["cache.kv_dtype=int4"], True),
    (["cache=offgraph"], True),                                         # the runtime may store int4
    (["cache=offgraph", "cache.center_keys=false"], False),
    (["backend=mlx", "cache=offgraph", "quantize=none"], False),        # MLX's runtime stores floats
    (["cache=static"], False),
])
def test_where_keys_are_centred_by_default(overrides, expected):
    cfg = compose_cfg(*overrides)
    assert center_keys(cfg, archs.lookup("llama")) is expected


@pytest.mark.parametrize("overrides,words", [
    (["cache=static", "cache.center_keys=true"], ["cache.center_keys", "cache.mode=static", "offgraph"]),
    (["backend=mlx", "cache=offgraph", "quantize=none", "cache.center_keys=true"],
     ["cache.center_keys", "backend=mlx", "float type"]),
])
def test_center_keys_where_it_cannot_be_built_is_refused(overrides, words):
    with pytest.raises(ConfigError) as e:
        preflight.check(compose_cfg(*overrides))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_sink_logits_refuse_centred_keys():
    assert key_offset.refused(archs.lookup("gpt_oss")) and not key_offset.refused(archs.lookup("llama"))
    assert not center_keys(compose_cfg("cache=offgraph"), archs.lookup("gpt_oss"))
