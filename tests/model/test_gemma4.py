"""Gemma 4 text on tiny random configs (conf/model/tiny_gemma4*.yaml): geometry from nested configs, the cache
layout of KV-shared layers, and the wrapped modules of every cache mode against HF's uncached forward."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.model import sources
from pipeline.model.cache_modes import wrap
from pipeline.model.cache_modes import offgraph as og
from pipeline.model.checkpoint import keep_text_model
from pipeline.model.geometry import from_config_json, from_hf_config
from pipeline.model.kv.layout import cache_layout
from pipeline.model.kv.runtime_cache import OffgraphCache
from pipeline.stages.wrap import self_check
from tests.helpers import compose_cfg

CONFIGS = ["tiny_gemma4", "tiny_gemma4_keqv"]


def hf_config(name: str):
    from transformers import AutoConfig
    d = dict(sources.random_hf_config(compose_cfg(f"model={name}").model.random))
    return AutoConfig.for_model(d.pop("model_type"), **d)


def tiny_model(name: str):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.float32, attn_implementation="sdpa").eval()


def test_geometry_reads_per_layer_dims_sharing_and_nested_text_config():
    d = sources.random_hf_config(compose_cfg("model=tiny_gemma4").model.random)
    flat, nested = from_hf_config(d), from_hf_config({"model_type": "gemma4", "text_config": d})
    assert flat == nested
    # the same model's config.json as transformers saves it (per-layer overrides, no global_head_dim)
    saved = hf_config("tiny_gemma4").to_dict()
    assert "per_layer_config" in saved and from_hf_config(saved) == flat
    assert flat.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert flat.kv_source == [0, 1, 2, 3, 3, 2]  # layer 4 (sliding) reads 3, layer 5 (full) reads 2
    assert flat.layer_head_dims == [16, 16, 32, 16, 16, 32]
    lin = flat.linears()
    assert "model.layers.4.self_attn.k_proj" not in lin and "model.layers.3.self_attn.k_proj" in lin
    assert lin["model.layers.5.mlp.down_proj"] == 256 and lin["model.layers.3.mlp.down_proj"] == 128  # double-wide
    assert lin["model.layers.0.per_layer_projection"] == 32 and lin["model.layers.2.self_attn.o_proj"] == 128
    keqv = from_hf_config(sources.random_hf_config(compose_cfg("model=tiny_gemma4_keqv").model.random))
    assert keqv.layer_kv_heads == [2, 1, 2, 1] and keqv.k_eq_v_layers == [1, 3]
    assert "model.layers.1.self_attn.v_proj" not in keqv.linears()
    # the model HF builds has exactly the linears the geometry lists
    names = {n for n, m in tiny_model("tiny_gemma4").named_modules() if isinstance(m, torch.nn.Linear)}
    assert names == set(lin)


def test_shared_layers_map_to_their_source_cache_and_windows_cannot_desync_them():
    cfg = hf_config("tiny_gemma4")
    lay = cache_layout(cfg)
    assert lay.layer_cache == [0, 1, 2, 3, 3, 2] and lay.n_caches == 4 and lay.n_shared == 2
    assert [(s.kv_heads, s.head_dim, s.window) for s in lay.specs] == [(1, 16, 16), (1, 16, 16), (1, 32, 0),
                                                                       (1, 16, 16)]
    # --kv-windows is a pattern over the caches: a shared layer has none, it follows its source's whatever the pattern
    for pattern in ([4, 0], [0], [7, 5, 3]):
        w = cache_layout(cfg, pattern)
        assert w.layer_cache == lay.layer_cache
        assert [s.window for s in w.specs] == [pattern[i % len(pattern)] for i in range(4)]
        assert [(s.kv_heads, s.head_dim) for s in w.specs] == [(s.kv_heads, s.head_dim) for s in lay.specs]
    consts = og.constant_methods(cfg, 64, 8, og.FLAGS[0])
    assert consts["get_n_caches"] == 4 and consts["get_n_shared_layers"] == 2
    assert consts["get_head_dims"].tolist() == [16, 16, 32, 16]
    assert "get_n_shared_layers" not in og.constant_methods(hf_config("tiny_gemma4_keqv"), 64, 8, og.FLAGS[0])


def test_offgraph_cache_holds_one_copy_of_shared_layers():
    model = tiny_model("tiny_gemma4")
    w = og.OffgraphLM(model, 64, "last", prefill_chunk=8, initial_capacity=64)
    # 3 rings of 16 + 8 - 1 = 23 slots (1 head x 16 dims) + 1 flat layer of 64 (1 x 32), K and V, fp32
    expect = 2 * 4 * (3 * 23 * 16 + 64 * 32)
    assert w.cache.nbytes() == expect == 25216
    # without sharing (every layer its own K/V, as a non-shared 6-layer model would hold): 4 rings + 2 flat
    unshared = OffgraphCache([w.layout.specs[c] for c in w.layout.layer_cache], 64, 8, 64)
    assert unshared.nbytes() == 2 * 4 * (4 * 23 * 16 + 2 * 64 * 32) == 44544
    assert w.cache.describe().endswith("4 layers: 1 flat + 3 ring(window 16), 2 shared")
    # a shared layer writes nothing: after a step, its source's entries are the only copy
    w(torch.arange(3, 11)[None], torch.arange(8))
    assert w.cache.length == 8


SDPA_ONLY = {"custom_sdpa": True, "custom_kv_cache": False}
KV_ONLY = {"custom_sdpa": False, "custom_kv_cache": True}
# cache mode, custom-op flags (None: the mode's default; custom: both)
MODES = {"static": ("static", None), "custom": ("custom", None), "custom_sdpa": ("custom", SDPA_ONLY),
         "custom_kv_cache": ("custom", KV_ONLY), "offgraph": ("offgraph", None)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", CONFIGS)
def test_wrapped_matches_hf_past_the_window(name, mode):
    model = tiny_model(name)
    for logits_mode in ("last", "full"):  # last: HF runs the shared layers on the last row only
        cache_mode, flags = MODES[mode]
        module = wrap(model, cache_mode, 64, logits_mode, 8, flags)
        check = self_check(module, model, 64, 8, 16, 512)
        assert check["tokens"] > 16 and check["max_abs_err"] < 1e-4, (name, mode, logits_mode, check)


@pytest.mark.parametrize("mode", ["custom_sdpa", "custom_kv_cache"])
@pytest.mark.parametrize("name", CONFIGS)
def test_each_custom_flag_alone_matches_hf_with_the_mlx_ops(name, mode):
    """The same parity once the MLX delegate's ops are switched in (pipeline/backends/mlx/attention.py), eagerly:
    a KV-shared layer reads its source's buffers there too."""
    from pipeline.backends.mlx import setup
    from pipeline.backends.mlx.attention import prepare_attention
    setup()
    model = tiny_model(name)
    module = wrap(model, "custom", 64, "last", 8, MODES[mode][1])
    prepare_attention(module, "custom", 64, MODES[mode][1])
    with torch.no_grad():
        check = self_check(module, model, 64, 8, 16, 512)
    assert check["tokens"] > 16 and check["max_abs_err"] < 1e-4, (name, mode, check)


def test_custom_mode_shared_layers_have_no_buffers():
    module = wrap(tiny_model("tiny_gemma4"), "custom", 64, "last", 8)
    assert len(module.slots) == 4 and module.slots == [23, 23, 64, 23]
    bufs = [n for n, _ in module.named_buffers() if n.endswith("k_cache")]
    assert [n.split(".")[3] for n in bufs] == ["0", "1", "2", "3"], bufs


@pytest.mark.parametrize("mode", ["custom_sdpa", "custom_kv_cache"])
def test_each_custom_flag_alone_keeps_one_copy_of_shared_layers(mode):
    """Layers 4 and 5 read layers 3 and 2's flat caches (64 positions): no buffers of their own, nothing written."""
    module = wrap(tiny_model("tiny_gemma4"), "custom", 64, "last", 8, MODES[mode][1])
    keys = {n: b for n, b in module.named_buffers() if n.endswith("k_cache") or n.startswith("k_cache_")}
    layer = {n: int(n.split(".")[3] if "." in n else n.rsplit("_", 1)[1]) for n in keys}
    assert sorted(layer.values()) == [0, 1, 2, 3], list(keys)
    assert [tuple(keys[n].shape) for n in sorted(keys, key=layer.get)] == [(1, 1, 64, 16)] * 2 + [(1, 1, 64, 32),
                                                                                             (1, 1, 64, 16)]
    module(torch.arange(3, 11)[None], torch.arange(8))
    assert all(keys[n][0, :, :8].abs().sum() > 0 and not keys[n][0, :, 8:].any() for n in keys)


def test_multimodal_checkpoint_keeps_its_text_model(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.models.gemma4 import Gemma4Config
    d = dict(sources.random_hf_config(compose_cfg("model=tiny_gemma4").model.random))
    d.pop("model_type")
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(Gemma4Config(text_config=d, vision_config=None, audio_config=None)).eval()
    full.save_pretrained(tmp_path)
    assert from_config_json(tmp_path / "config.json").kv_source == [0, 1, 2, 3, 3, 2]  # nested, read for preflight
    info = keep_text_model(tmp_path)
    assert info["text_model"] == {"from": "Gemma4ForConditionalGeneration", "to": "Gemma4ForCausalLM"}
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma4_text"
    text = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(3, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(text(ids).logits, full(ids).logits)
    assert keep_text_model(tmp_path) == {}  # already text-only


@pytest.mark.slow  # ~50 s: a process of its own, two checkpoints written
def test_gemma4_recipe_builds_a_multimodal_hub_checkpoint_offline(tmp_path):
    """conf/model/gemma4.yaml's repo, published in a hub cache as a tiny multimodal checkpoint (config.json nests
    text_config): preflight reads the nested geometry, download keeps the text model, wrap checks it."""
    import shutil

    from transformers.models.gemma4 import Gemma4Config

    from pipeline.model.tiny_tokenizer import train
    from pipeline.paths import ROOT
    from tests.helpers import run_cli
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--google--gemma-4-E2B-it"
    snap = repo / "snapshots" / commit
    d = dict(sources.random_hf_config(compose_cfg("model=tiny_gemma4").model.random))
    d.pop("model_type")
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_config(Gemma4Config(text_config=d, vision_config=None, audio_config=None)) \
        .save_pretrained(snap)
    train(512, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    out = f"outputs/test-gemma4-hub-{tmp_path.name}"
    r = run_cli("recipe=gemma4_offgraph_4w", "export.max_context_len=64", "export.prefill_chunk=8", "run.until=wrap",
                f"run.output_dir={out}", "run.progress=false",
                env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        run_manifest = json.loads((ROOT / r.stdout.strip().splitlines()[-1].split(": ", 1)[1]).read_text())
        stage = json.loads((Path(run_manifest["stages"][0]["path"]) / "manifest.json").read_text())
        assert stage["info"]["text_model"]["to"] == "Gemma4ForCausalLM" and stage["info"]["commit"] == commit
        wrap_info = json.loads((Path(run_manifest["stages"][1]["path"]) / "wrap.json").read_text())
        assert wrap_info["self_check"]["max_abs_err"] < 1e-4 and wrap_info["self_check"]["tokens"] > 16
    finally:
        shutil.rmtree(ROOT / out, ignore_errors=True)


def test_kv_sharing_without_a_source_layer_is_a_config_error():
    from pipeline.preflight import check
    from pipeline.errors import ConfigError
    cfg = compose_cfg("recipe=tiny_gemma4_offgraph", "model.random.num_kv_shared_layers=5")
    with pytest.raises(ConfigError) as e:
        check(cfg)
    text = str(e.value)
    assert "model.random" in text and "num_kv_shared_layers=5" in text and "full_attention" in text


def _cache_buffer_bytes(module) -> int:
    """Bytes of the K/V storage a wrapped module allocated: the off-graph cache it owns, or its cache buffers
    (k_cache / v_cache, HF's static k_cache_<i> / v_cache_<i>, update_cache's kv_k_cache / kv_v_cache)."""
    if isinstance(module, og.OffgraphLM):
        return module.cache.nbytes()
    return sum(b.numel() * b.element_size() for n, b in module.named_buffers()
               if n.rsplit(".", 1)[-1].startswith(("k_cache", "v_cache", "kv_k_cache", "kv_v_cache")))


@pytest.mark.parametrize("context", [64, 20])  # 20: rings of 16 + 8 - 1 slots capped at the context
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", CONFIGS + ["tiny_llama", "tiny_gemma3"])
def test_preflight_kv_estimate_is_what_the_wrapped_module_allocates(name, mode, dtype, context):
    """memory_estimate's kv_cache_bytes, from the geometry alone, equals the bytes each cache mode's module allocates:
    per-layer heads and dims, no storage for KV-shared layers, rings only where the mode keeps them."""
    from pipeline import memory_estimate
    from pipeline.model.cache_modes import CACHE_MODES
    cache_mode, mode_flags = MODES[mode]
    mode_flags = mode_flags or CACHE_MODES[cache_mode].FLAGS[0]
    cfg = compose_cfg(f"model={name}", f"cache={cache_mode}", f"cache.custom_sdpa={mode_flags['custom_sdpa']}",
                      f"cache.custom_kv_cache={mode_flags['custom_kv_cache']}", f"export.dtype={dtype}",
                      f"export.max_context_len={context}", "export.prefill_chunk=8")
    model = tiny_model(name).to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    module = wrap(model, cache_mode, context, "last", 8, mode_flags)
    estimate = memory_estimate.kv_cache_bytes(cfg, sources.geometry(cfg.model))
    assert estimate == _cache_buffer_bytes(module) > 0, (name, mode, dtype, context)
    if (name, cache_mode, dtype, context) == ("tiny_gemma4", "offgraph", "fp32", 64):
        assert estimate == 25216  # the C++ runner's cache at capacity 64, chunk 8 (tests/native/test_gemma4_native.py)
