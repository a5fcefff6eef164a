"""python -m pipeline validate [DIR]: every recipe checked without downloading or building anything."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline import memory_estimate, preflight
from pipeline.model.geometry import Geometry
from tests.helpers import ROOT, compose_cfg


def run(*args):
    return subprocess.run([sys.executable, "-m", "pipeline", "validate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_project_recipes_all_pass():
    r = run()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 with problems" in r.stdout
    for name in ("smollm2_custom", "gemma3_offgraph", "tiny_llama_xnnpack"):
        assert name in r.stdout


def test_a_users_folder_reports_every_problem_of_every_recipe(tmp_path):
    (tmp_path / "good.yaml").write_text("# @package _global_\ndefaults:\n  - override /model: tiny_llama\n")
    (tmp_path / "bad_chunk.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: tiny_gemma3\n  - override /cache: offgraph\n"
        "export:\n  max_context_len: 64\n  prefill_chunk: 32\ncache:\n  custom_sdpa: true\n")
    (tmp_path / "typo.yaml").write_text("# @package _global_\nexport:\n  prefil_chunk: 8\n")
    r = run(str(tmp_path))
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    assert "3 recipe(s), 2 with problems" in out
    good = next(ln for ln in out.splitlines() if ln.startswith("good "))
    assert " ok " in good
    # both problems of bad_chunk, named by key and value
    assert "export.prefill_chunk=32" in out and "smallest sliding window 16" in out
    assert "cache.custom_sdpa/custom_kv_cache" in out
    assert "typo" in out and "prefil_chunk" in out


def test_missing_folder_is_a_usage_error(tmp_path):
    r = run(str(tmp_path / "nope"))
    assert r.returncode == 2 and "not a folder" in r.stdout


def test_memory_estimates():
    g = Geometry(arch="llama", hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                 num_kv_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
    assert abs(memory_estimate.parameter_count(g) - 134.5e6) < 0.5e6  # SmolLM2-135M
    cfg = compose_cfg("recipe=smollm2_xnnpack", "export.max_context_len=512")
    # 30 layers x 512 positions x K and V x 3 heads x 64 dims x fp32
    assert memory_estimate.kv_cache_bytes(cfg, g) == 30 * 512 * 2 * 3 * 64 * 4
    assert preflight.memory_problems(cfg, g, total_bytes=1 << 30)  # 1 GiB cannot export it
    assert not preflight.memory_problems(cfg, g, total_bytes=24 << 30)


@pytest.mark.parametrize("name", ["smollm2", "gemma3_270m", "gemma4_e2b", "gemma4_default", "gemma4_keqv"])
def test_parameter_count_is_the_models(name):
    """preflight's count from the geometry against the model transformers builds (on the meta device): per-layer
    head dims, KV-shared layers without K/V, double-width MLPs, Gemma 4's per-layer embedding table."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, Gemma4TextConfig, LlamaConfig
    from pipeline.model.geometry import from_hf_config
    from tests.helpers import GEMMA4_E2B_TEXT_CONFIG
    e2b = {k: x for k, x in GEMMA4_E2B_TEXT_CONFIG.items() if k != "model_type"}
    config = {"smollm2": lambda: LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                             num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                             tie_word_embeddings=True),
              "gemma3_270m": lambda: Gemma3TextConfig(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                                      num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                                      vocab_size=262144),
              "gemma4_e2b": lambda: Gemma4TextConfig(**e2b),
              "gemma4_default": Gemma4TextConfig,
              "gemma4_keqv": lambda: Gemma4TextConfig(**dict(e2b, attention_k_eq_v=True, num_global_key_value_heads=2,
                                                               num_kv_shared_layers=10, use_double_wide_mlp=False))
              }[name]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    norms = sum(p.numel() for n, p in model.named_parameters() if p.dim() < 2 or "norm" in n)
    counted = memory_estimate.parameter_count(from_hf_config(config.to_dict()))
    assert abs(counted - sum(p.numel() for p in model.parameters())) <= norms, (counted, norms)


def test_rings_shrink_the_kv_estimate_of_custom_and_offgraph():
    g = Geometry(arch="gemma3", hidden_size=640, intermediate_size=2048, num_layers=2, num_heads=4, num_kv_heads=1,
                 head_dim=256, vocab_size=1000, layer_types=["sliding_attention", "full_attention"],
                 sliding_window=512)
    static = compose_cfg("recipe=gemma3_xnnpack", "export.max_context_len=4096")
    offgraph = compose_cfg("recipe=gemma3_offgraph", "export.max_context_len=4096", "export.prefill_chunk=128")
    slot = 2 * 256 * 4
    assert memory_estimate.kv_cache_bytes(static, g) == 2 * 4096 * slot
    assert memory_estimate.kv_cache_bytes(offgraph, g) == (512 + 128 - 1 + 4096) * slot



def test_gemma4_kv_estimate_counts_per_layer_dims_and_no_cache_for_shared_layers():
    """Each cache with its own layer's heads and dims; KV-shared layers hold none (tests/model/test_gemma4.py
    checks the same figures against the bytes each cache mode's wrapped module allocates)."""
    from pipeline.model import sources

    def estimate(model, mode, *overrides):
        cfg = compose_cfg(f"model={model}", f"cache={mode}", "export.max_context_len=64", "export.prefill_chunk=8",
                          *overrides)
        return memory_estimate.kv_cache_bytes(cfg, sources.geometry(cfg.model))

    # tiny_gemma4: caches of layers 0, 1, 3 (sliding, 1 x 16) and 2 (full, 1 x 32); layers 4 and 5 read 3 and 2
    assert estimate("tiny_gemma4", "static") == 2 * 4 * (3 * 64 * 16 + 64 * 32) == 40960
    assert estimate("tiny_gemma4", "offgraph") == 2 * 4 * (3 * 23 * 16 + 64 * 32) == 25216  # the C++ runner's
    assert estimate("tiny_gemma4", "offgraph", "export.dtype=bf16") == 25216 // 2
    # attention_k_eq_v: global layers 1 and 3 with 1 KV head x 64 dims (values stored beside the keys, as wide),
    # sliding layers 0 and 2 with 2 x 16
    keqv = ("tiny_gemma4_keqv", "offgraph", "model.random.global_head_dim=64")
    assert estimate(*keqv) == 2 * 4 * (2 * 23 * 2 * 16 + 2 * 64 * 64) == 77312

def test_smoke_builds_a_real_recipe_on_a_tiny_model_of_its_architecture(tmp_path):
    (tmp_path / "smollm2_custom.yaml").write_text((ROOT / "recipes" / "smollm2_custom.yaml").read_text())
    r = subprocess.run([sys.executable, "-m", "pipeline", "validate", str(tmp_path), "--smoke"], cwd=ROOT,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "smollm2_custom (smoke on tiny_llama)" in r.stdout and "0 with problems" in r.stdout


def test_every_stage_has_an_estimate_and_a_build_that_would_not_fit_is_refused_before_download():
    from pipeline.errors import ConfigError
    from pipeline.model import sources
    from pipeline.stages import ORDER
    cfg = compose_cfg("recipe=scale_llama32_1b")  # Llama-3.2-1B geometry, random weights: nothing to read but config
    est = memory_estimate.memory_estimate(cfg, sources.geometry(cfg.model))
    assert sorted(est["stage_peak_bytes"]) == sorted(ORDER)
    assert est["peak_bytes"] == max(est["stage_peak_bytes"].values()) > est["weights_bytes"]
    assert preflight.check(cfg, total_bytes=24 << 30) is not None
    with pytest.raises(ConfigError, match=r"the \w+ stage needs about [\d.]+ GiB, this machine has 8.0 GiB"):
        preflight.check(cfg, total_bytes=8 << 30)


def test_verify_needs_more_where_the_cpu_lacks_the_native_4bit_gemm(monkeypatch):
    # the XNNPACK reference holds 8da4w weights as fp32 there (numerics.QB4WLinear), 3 bytes more a weight
    from pipeline.backends import xnnpack
    from pipeline.backends.xnnpack import numerics
    from pipeline.model import sources
    cfg = compose_cfg("recipe=scale_llama32_1b")
    g = sources.geometry(cfg.model)
    monkeypatch.setattr(numerics, "runs_native_gemm", lambda: True)
    native = memory_estimate.memory_estimate(cfg, g)["stage_peak_bytes"]
    assert xnnpack.reference_extra_bytes("8da4w", 32) == 0
    monkeypatch.setattr(numerics, "runs_native_gemm", lambda: False)
    fallback = memory_estimate.memory_estimate(cfg, g)["stage_peak_bytes"]
    assert {s: fallback[s] - native[s] for s in native if fallback[s] != native[s]}.keys() == {"verify"}
    assert fallback["verify"] - native["verify"] > 4 << 30  # 1.7 x 3 bytes x ~1 B linear weights
    # per channel (group 0) its dots sum in float64: 7 bytes more; other schemes and backends hold nothing more
    assert [xnnpack.reference_extra_bytes(*a) for a in (("8da4w", 32), ("8da4w", 0), ("8da8w", 0))] == [3, 7, 0]
    portable = compose_cfg("recipe=scale_llama32_1b", "backend=portable")
    assert memory_estimate.fallback_bytes(portable, g, memory_estimate.parameter_count(g)) == 0
