"""cache=custom with one flag (llmpipe::sdpa over HF's static cache; llmpipe::update_cache + the attention math), built by
the pipeline on both tiny models and both CPU backends: verify passes (the Python runtime against eager, exact gate) and
the C++ runner's greedy tokens equal the Python runtime's, and python -m pipeline generate agrees with the C++ runner.
(The CI tier builds one of them end to end: tests/test_export_llm_hf.py; the ops and kernels:
tests/model/test_custom_split.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import native
from pipeline.generation.runner import Sampler, Session, open_for_generation
from pipeline.runtimes import CachePolicy
from tests.helpers import build

FLAGS = {"sdpa": ("cache.custom_kv_cache=false",), "kv": ("cache.custom_sdpa=false",)}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xnnpack", "portable"])
@pytest.mark.parametrize("flags", sorted(FLAGS))
@pytest.mark.parametrize("recipe", ["tiny_llama_custom", "tiny_gemma3_custom"])
def test_one_flag_builds_verify_and_runners_agree(recipe, flags, backend):
    m = build(recipe, *FLAGS[flags], f"backend={backend}")
    assert m["status"] == "ok"
    assert m["verify"]["gate"] == "exact" and m["verify"]["native"]["token_parity"]
    # past the tiny Gemma's window (16) with the decode: the Python runner equals the C++ runner
    ids = list(range(3, 33))
    ours = Session(open_for_generation(Path(m["pte"]), CachePolicy())).generate(ids, 12, Sampler())
    theirs = native.run(m["pte"], m["tokenizer"], prompt_ids=ids, max_new_tokens=12, extra_args=native.cache_args(m))
    assert ours["generated_ids"] == theirs["generated_ids"]
