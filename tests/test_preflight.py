"""Bad input ends in one clear message (key, value, what is allowed), a non-zero exit, no traceback,
before any heavy work."""
from __future__ import annotations

import pytest

from tests.helpers import run_cli

CASES = {
    "unknown recipe": (["recipe=no_such_recipe"], ["recipe=no_such_recipe", "smollm2_xnnpack"]),
    "typo'd key": (["recipe=tiny_llama_xnnpack", "export.max_contex_len=3"], ["max_contex_len"]),
    "unknown choice": (["quantize=9w"], ["quantize=9w", "8da4w"]),
    "bad enum value": (["recipe=tiny_llama_xnnpack", "backend.name=tpu"], ["backend.name", "xnnpack"]),
    "bad scheme value": (["recipe=tiny_llama_xnnpack", "quantize.linear=3w"], ["quantize.linear", "'3w'", "8da4w"]),
    "chunk > sliding window": (["recipe=gemma3_xnnpack", "export.prefill_chunk=600"],
                               ["export.prefill_chunk=600", "sliding window 512"]),
    "chunk > context": (["recipe=tiny_llama_xnnpack", "export.prefill_chunk=100"],
                        ["export.prefill_chunk=100", "export.max_context_len=64"]),
    "group size": (["recipe=gemma3_xnnpack", "quantize=8da4w", "quantize.linear_group_size=256"],
                   ["quantize.linear_group_size=256", "640"]),
    "nvfp4 on xnnpack": (["recipe=tiny_llama_xnnpack", "quantize=nvfp4"], ["nvfp4", "mlx"]),
    "selected logits, static cache": (["recipe=tiny_llama_xnnpack", "export.logits_mode=selected"],
                                      ["export.logits_mode", "selected", "cache.mode=static allowed: ['full', 'last', 'tail']"]),
    "bad logits mode": (["recipe=tiny_llama_xnnpack", "export.logits_mode=some"], ["export.logits_mode", "selected"]),
    "tail logits, mlx": (["recipe=tiny_llama_mlx", "export.logits_mode=tail"],
                         ["export.logits_mode='tail'", "backend=mlx cannot lower it"]),
    "no tail rows": (["recipe=tiny_llama_custom", "export.tail_rows=0"], ["export.tail_rows=0", "must be >= 1"]),
    "missing gguf path": (["recipe=smollm2_xnnpack", "model.path=/nonexistent/model.gguf"],
                          ["model.path", "/nonexistent/model.gguf", "no such GGUF file"]),
    "package not installed": (["recipe=smollm2_xnnpack", "model.package=no-such-model-package"],
                              ["model.package", "no-such-model-package", "not installed"]),
    "kv dtype, off-graph": (["recipe=tiny_llama_offgraph", "cache.kv_dtype=fp16"],
                            ["cache.kv_dtype='fp16'", "verify.runtime.kv_storage_dtype"]),
    "kv dtype, one custom op": (["recipe=tiny_llama_custom", "cache.custom_kv_cache=false", "cache.kv_dtype=bf16"],
                                ["cache.kv_dtype='bf16'", "needs both custom_sdpa and custom_kv_cache"]),
    "kv dtype, mlx": (["recipe=tiny_llama_mlx", "cache.kv_dtype=fp16"], ["cache.kv_dtype='fp16'", "MLX's cache ops"]),
    "kv dtype int8, mlx runtime": (["recipe=tiny_llama_mlx", "cache=offgraph", "verify.runtime.kv_storage_dtype=int8"],
                                   ["verify.runtime.kv_storage_dtype='int8'", "backend=mlx allowed: ['fp32', 'fp16'",
                                    "the MLX runtime's own off-graph cache"]),
    "kv dtype int4, mlx runtime": (["recipe=tiny_llama_mlx", "cache=offgraph", "verify.runtime.kv_storage_dtype=int4"],
                                   ["verify.runtime.kv_storage_dtype='int4'", "int8 and int4 rows are our caches'"]),
    "kv dtype int2": (["recipe=tiny_llama_custom", "cache.kv_dtype=int2"], ["cache.kv_dtype", "int2", "int4"]),
    "target bits below the cheapest plan": (["quantize.target_bpw=5.0"],
                                            ["quantize.target_bpw=5.0", "8da4w g0", "5.88 bits/weight"]),
    "output outside outputs/": (["recipe=tiny_llama_xnnpack", "run.output_dir=/tmp/elsewhere"],
                                ["run.output_dir", "/tmp/elsewhere", "must be inside"]),
    # cache.mode=stock builds on ExecuTorch's own ops alone: what they cannot build names cache.mode=custom instead
    "stock cache, attention sinks": (["model=tiny_llama", "model.random.arch=gpt_oss", "cache=stock"],
                                     ["cache.mode='stock'", "attention sinks", "cache.mode=custom"]),
    "stock cache, recurrent layers": (["model=tiny_llama", "model.random.arch=lfm2", "cache=stock"],
                                      ["cache.mode='stock'", "recurrent layers (conv)", "cache.mode=custom"]),
    "stock cache, KV-shared layers": (["recipe=tiny_gemma4_custom", "cache=stock"],
                                      ["cache.mode='stock'", "KV-shared layers", "cache.mode=custom"]),
    "stock cache, mlx": (["recipe=tiny_llama_mlx", "cache=stock"],
                         ["cache.mode='stock'", "backend=mlx refuses it", "llama::custom_sdpa", "cache.mode=custom"]),
    "stock cache, half K/V": (["recipe=tiny_llama_custom", "cache=stock", "cache.kv_dtype=fp16"],
                              ["cache.kv_dtype='fp16'", "the query's dtype"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_clear_message(name):
    args, needles = CASES[name]
    r = run_cli(*args, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "Traceback" not in out, out
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out}"
    assert "stage=" not in out, "no stage may start on a rejected config"


def test_hub_source_offline_is_clear(tmp_path):
    r = run_cli("recipe=smollm2_xnnpack", "model=smollm2_hf", timeout=120,
                env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)})
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out, out
    assert "model.repo_id" in out and "offline" in out and "HuggingFaceTB/SmolLM2-135M-Instruct" in out


def test_a_kernel_path_that_does_not_exist_is_refused_before_any_stage():
    r = run_cli("recipe=tiny_llama_custom", timeout=120, env={"LLMPIPE_ISA": "sse9"})
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out and "stage=" not in out, out
    assert "LLMPIPE_ISA (environment)='sse9'" in out and "avx2" in out, out
