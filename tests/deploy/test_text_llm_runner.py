"""ExecuTorch's own runner runs our programs: the default build and tiny programs of every in-graph kind, each run in a
fresh process through TextLLMRunner after `pipeline.ops.load()`, give llm_runner's greedy tokens on the same raw prompt;
the programs TextLLMRunner cannot drive say so in their run manifest, with the runners that run them.

The tiny models here have the vocabulary of their tokenizer (480 ids): TextLLMRunner samples over the tokenizer's ids,
so a random model whose argmax lands on a padded id beyond it would part from llm_runner for that reason alone.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import native
from tests.e2e.test_families import build_family
from tests.helpers import build

HERE = Path(__file__).resolve().parent
VOCAB = "model.random.vocab_size=480"  # the tiny tokenizer's own size
PROMPT = "The capital of France is"
# longer than the tiny programs' chunks (8, 16): TextLLMRunner prefills it in pieces; past gemma3's window of 16
LONG = ("Write a haiku about the sea: waves fold into foam, salt wind carries gull voices, the tide keeps its time. "
        "What is the capital of France?")


def text_llm_runner(m: dict, prompt: str, new: int, tmp_path: Path) -> dict:
    out = tmp_path / "etrunner.json"
    proc = subprocess.run([sys.executable, str(HERE / "text_llm_runner_ids.py"), m["pte"], m["tokenizer"], prompt,
                           str(new), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def llm_runner(m: dict, prompt: str, new: int) -> dict:
    return native.run(m["pte"], m["tokenizer"], prompt=prompt, chat="0", max_new_tokens=new)


def same_tokens(m: dict, prompt: str, new: int, tmp_path: Path) -> dict:
    assert m["status"] == "ok", m.get("error")
    assert m["deploy"]["runners"]["text_llm_runner"], m["deploy"]["runners"]
    et, ours = text_llm_runner(m, prompt, new, tmp_path), llm_runner(m, prompt, new)
    assert et["prompt_ids"] == ours["prompt_ids"]  # the same raw prompt, encoded the same
    assert len(et["generated_ids"]) == len(ours["generated_ids"]) > 0
    assert et["generated_ids"] == ours["generated_ids"]
    return et


@pytest.mark.real_model
def test_the_default_build_answers_in_text_llm_runner_as_in_llm_runner(smollm2_default, tmp_path):
    et = same_tokens(smollm2_default, PROMPT, 16, tmp_path)
    assert len(et["generated_ids"]) == 16 and "Paris" in et["text"]
    dep = smollm2_default["deploy"]
    assert set(dep["beyond_stock"]) == {"llmpipe::cached_attention.out", "llmpipe::tied_head.out"}
    assert dep["namespaces"] == ["aten", "executorch_prim", "llmpipe", "quantized_decomposed"]


@pytest.mark.slow
@pytest.mark.real_model
def test_the_stock_build_needs_nothing_of_ours_and_answers_in_text_llm_runner(tmp_path):
    """recipe=smollm2_stock: ExecuTorch's kernels in TextLLMRunner, our twins of them in llm_runner (other float bits:
    an 8da4w program's tokens may part at a near-tie, which verify bounds), the same answer."""
    m = build("smollm2_stock")
    dep = m["deploy"]
    assert dep["needs_ours"] is False and not [op for op in dep["operators"] if op.startswith("llmpipe::")]
    assert set(dep["beyond_stock"]) == {"llama::custom_sdpa.out", "llama::update_cache.out"}
    et, ours = text_llm_runner(m, PROMPT, 16, tmp_path), llm_runner(m, PROMPT, 16)
    assert et["prompt_ids"] == ours["prompt_ids"] and "Paris" in et["text"] and "Paris" in ours["text"]


TINY = {
    "static (HF's cache in the program)": lambda: build("tiny_llama_xnnpack", VOCAB, "verify.enabled=false"),
    "custom": lambda: build("tiny_llama_custom", VOCAB, "verify.enabled=false"),
    "custom with rings": lambda: build("tiny_gemma3_custom", VOCAB, "verify.enabled=false"),
    "recurrent hybrid (conv)": lambda: build_family("lfm2", "xnnpack", "custom", "fp32", VOCAB, "verify.enabled=false"),
    "recurrent hybrid (gated delta), 8da4w": lambda: build_family("qwen3_5_text", "xnnpack", "custom", "default", VOCAB,
                                                                  "verify.enabled=false"),
    "mixture of experts, 8da4w": lambda: build_family("qwen3_moe", "xnnpack", "custom", "default", VOCAB,
                                                      "verify.enabled=false"),
    # ExecuTorch's own LLM ops alone: its kernels in TextLLMRunner, native/'s twins of them in llm_runner
    "stock": lambda: build("tiny_llama_custom", VOCAB, "cache=stock", "verify.enabled=false"),
    "stock with window masks": lambda: build("tiny_gemma3_custom", VOCAB, "cache=stock", "verify.enabled=false"),
}


@pytest.mark.parametrize("kind", list(TINY))
def test_in_graph_programs_run_in_text_llm_runner_as_in_llm_runner(kind, tmp_path):
    same_tokens(TINY[kind](), LONG, 16, tmp_path)


def test_what_text_llm_runner_cannot_drive_is_named_with_its_runners():
    og = build("tiny_llama_offgraph", VOCAB, "verify.enabled=false")
    r = og["deploy"]["runners"]
    assert not r["text_llm_runner"] and "cache.mode=offgraph" in r["text_llm_runner_why"]
    assert r["runners"] == ["python -m pipeline generate", "llm_runner", "llm_batched_runner"]
    sel = build("tiny_llama_custom", VOCAB, "verify.enabled=false", "export.logits_mode=selected")
    r = sel["deploy"]["runners"]
    assert not r["text_llm_runner"] and "third input" in r["text_llm_runner_why"]
    assert "llm_runner" in r["runners"] and "TextLLMRunner" not in r["runners"]
