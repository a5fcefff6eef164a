"""pipeline/fidelity.py: the figures of llama-perplexity --kl-divergence, on the fixed corpus."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from pipeline.fidelity import CORPUS, Accumulator, corpus_chunks, scored_range
from tests.helpers import build


def test_identical_logits_cost_nothing():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 100, generator=g)
    targets = torch.randint(0, 100, (64,), generator=g)
    a = Accumulator()
    a.add(ref, ref.clone(), targets)
    r = a.result()
    assert r["kld_max"] < 1e-6 and r["same_top1"] == 1.0 and r["rms_dp"] < 1e-6
    assert math.isclose(r["ppl"], r["ppl_float"], rel_tol=1e-6)


def test_the_figures_of_a_known_difference():
    """Two tokens: the engine puts p=0.5 where the reference puts p=0.9 on token 0."""
    ref = torch.log(torch.tensor([[0.9, 0.1], [0.9, 0.1]]))
    got = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    a = Accumulator()
    a.add(ref, got, torch.tensor([0, 1]))
    r = a.result()
    kld = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert math.isclose(r["kld_mean"], kld, rel_tol=1e-5) and r["same_top1"] == 1.0
    assert math.isclose(r["rms_dp"], 0.4, rel_tol=1e-5)              # |0.5 - 0.9| and |0.5 - 0.1|
    assert math.isclose(r["ppl"], 2.0, rel_tol=1e-5)                 # both tokens at p = 0.5
    assert math.isclose(r["ppl_float"], math.exp(-(math.log(0.9) + math.log(0.1)) / 2), rel_tol=1e-5)


@pytest.fixture(scope="module")
def fp32_build():
    return build("tiny_llama_xnnpack", "verify.fidelity_chunks=2")


def test_the_corpus_is_long_enough_and_chunked_with_bos(fp32_build):
    tok = AutoTokenizer.from_pretrained(fp32_build["model_dir"])
    chunks = corpus_chunks(tok, 64, 4)
    assert len(chunks) == 4 and all(len(c) == 64 for c in chunks)
    assert len(CORPUS.read_text().split()) > 5000  # words of prose: thousands of tokens for any tokenizer
    with pytest.raises(ValueError, match="chunks of 64 tokens"):
        corpus_chunks(tok, 64, 10**6)
    assert scored_range(64) == (31, 63)


def test_verify_scores_the_program_on_the_corpus(fp32_build):
    f = fp32_build["verify"]["fidelity"]
    assert f["n_ctx"] == 64 and f["tokens"] == 2 * 32
    assert f["kld_mean"] < 1e-5 and f["same_top1"] == 1.0            # fp32: the program is the float model
    assert math.isclose(f["ppl"], f["ppl_float"], rel_tol=1e-3)
