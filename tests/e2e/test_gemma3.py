"""End to end on gemma-3-270m with the off-graph cache (CI: the shared chunk-128 build) and the custom in-graph
cache (slow tier): built and verified exactly, then a prompt longer than the 512-token sliding window through the
C++ runner (the rings wrap), against HF eager."""
from __future__ import annotations

import pytest
import torch

from pipeline import native
from tests.helpers import build_cli

pytestmark = pytest.mark.real_model
TEXT = ("The lighthouse keeper wrote in his log every evening: the weather, the ships that passed, the "
        "colour of the sea, and whatever small thing had surprised him that day. ")


# chunk 128: rings of 512 + 128 - 1 = 639 slots, so a 700-token prompt wraps them (at the recipes'
# chunk 512 a ring of 1023 slots never wraps within the 1024-token context)
CHUNK = "export.prefill_chunk=128"


@pytest.fixture(scope="module")
def built(gemma3_offgraph) -> dict:
    return gemma3_offgraph


@pytest.fixture(scope="module")
def built_custom() -> dict:
    return build_cli("gemma3_custom", CHUNK)


@pytest.fixture(scope="module")
def hf_model(gemma3_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(gemma3_model_dir, dtype=torch.float32).eval()


def long_prompt(built, n: int) -> list[int]:
    ids, text = [], TEXT
    while len(ids) < n:
        ids = native.encode(built["tokenizer"], text, "0", pte=built["pte"])
        text += TEXT
    return ids[:n]


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def test_verified_exactly_with_the_cache_report(built):
    s = built["verify"]
    assert s["same_quant"]["greedy_match"] == s["same_quant"]["greedy_total"] > 0
    assert s["native"]["token_parity"]
    assert s["native"]["cache_report"].startswith("[cache] off-graph seq | capacity=1024 initial=512")
    assert s["native"]["cache_report"].endswith("18 layers: 3 flat + 15 ring(window 512)")


def test_prompt_past_the_window_wraps_the_rings_and_matches_eager(built, hf_model):
    ids = long_prompt(built, 700)
    n = 12
    stats = native.run(built["pte"], built["tokenizer"], prompt_ids=ids, max_new_tokens=n,
                       extra_args=["--kv-max-capacity", "1024", "--ignore-eos"])
    assert stats["generated_ids"] == hf_greedy(hf_model, ids, n)
    # ring layers: window 512 + chunk 128 - 1 slots; flat layers: 512 doubled once to cover 711 positions;
    # 1 KV head, K and V of 256 dims, fp32
    slot = 1 * (256 + 256) * 4
    assert stats["cache_bytes"] == (15 * (512 + 128 - 1) + 3 * 1024) * slot


def test_all_flat_windows_match_eager_within_the_window(built, hf_model):
    ids = long_prompt(built, 200)
    n = 8
    stats = native.run(built["pte"], built["tokenizer"], prompt_ids=ids, max_new_tokens=n,
                       extra_args=["--kv-max-capacity", "1024", "--kv-windows", "0", "--ignore-eos"])
    assert stats["cache_report"].endswith("18 layers: 18 flat")
    assert stats["generated_ids"] == hf_greedy(hf_model, ids, n)


@pytest.mark.slow
def test_custom_verified_exactly_and_past_the_window_in_cpp(built_custom, hf_model):
    s = built_custom["verify"]
    assert s["same_quant"]["greedy_match"] == s["same_quant"]["greedy_total"] > 0
    assert s["native"]["token_parity"]
    # 15 sliding layers hold rings of 512 + 128 - 1 slots in the program
    assert s["native"]["cache_report"] == ("[cache] in-graph (program-owned) | capacity=1024 | "
                                           "15 ring layers (window 512, 639 slots)")
    ids = long_prompt(built_custom, 700)
    stats = native.run(built_custom["pte"], built_custom["tokenizer"], prompt_ids=ids, max_new_tokens=12,
                       extra_args=["--ignore-eos"])
    assert stats["generated_ids"] == hf_greedy(hf_model, ids, 12)
