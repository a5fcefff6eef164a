"""export.strict (pipeline/exporters/native.py strict_export): null exports non-strict where the backend lowers such a
program and the cache mode's module exports to one, in fp32, and strict elsewhere; a non-strict program computes
the strict one's bits."""
from __future__ import annotations

import json

import pytest
import torch

from tests.exporters.test_fused_projections import UP_TO_LOWER, _program_logits
from tests.helpers import build, compose_cfg, stage_path


@pytest.mark.parametrize("overrides,strict", [
    ((), False),                                              # the default build: xnnpack, custom cache, fp32
    (("recipe=tiny_gemma3_offgraph",), False),
    (("recipe=tiny_llama_xnnpack",), True),                   # HF's static cache
    (("cache.custom_kv_cache=false",), True),                 # custom_sdpa alone: HF's static cache too
    (("recipe=tiny_llama_mlx",), True),                       # MLX's quantized tensors
    (("export.dtype=bf16",), True),                           # half programs: not measured
    (("export.strict=true",), True),                          # set by hand: as set
    (("recipe=tiny_llama_xnnpack", "export.strict=false"), False),
])
def test_null_picks_non_strict_only_where_it_lowers(overrides, strict):
    from pipeline.exporters.native import strict_export
    assert strict_export(compose_cfg(*overrides)) is strict


@pytest.mark.parametrize("recipe,overrides", [
    ("tiny_llama_custom", ("quantize=8da4w",)),
    ("tiny_gemma3_offgraph", ()),
])
def test_a_non_strict_program_gives_the_strict_bits(recipe, overrides):
    auto = build(recipe, *overrides, stages=UP_TO_LOWER)
    strict = build(recipe, *overrides, "export.strict=true", stages=UP_TO_LOWER)
    info = json.loads((stage_path(auto, "export") / "manifest.json").read_text())["metrics"]
    assert info["strict"] is False
    a = _program_logits(stage_path(auto, "lower") / "model.pte")
    b = _program_logits(stage_path(strict, "lower") / "model.pte")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
