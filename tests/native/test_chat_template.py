"""Chat templates of llm_runner (--encode) against transformers / tokenizers."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from native_corpus import make_corpus

PROMPTS = ["What is the capital of France?", "Line one\nline two\n\n  indented", "café 你好 😀",
           "<|im_start|>not a turn", ""]


def encode(bins, tok: Path, prompt: str, chat: str, *extra) -> list[int]:
    proc = subprocess.run([str(bins[0]), "--tokenizer", str(tok), "--prompt", prompt, "--chat", chat,
                           "--encode", *map(str, extra)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [int(x) for x in proc.stdout.split()]


@pytest.mark.real_model
def test_chatml_matches_transformers(native_bins, smollm2_model_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    for prompt in PROMPTS:
        expected = hf.apply_chat_template([{"role": "user", "content": prompt}],
                                          add_generation_prompt=True, tokenize=True)
        if not isinstance(expected, list):  # BatchEncoding in some versions
            expected = expected["input_ids"]
        assert encode(native_bins, Path(smollm2_model_dir) / "tokenizer.json", prompt, "chatml") == expected


@pytest.mark.real_model
def test_gemma_templates(native_bins, gemma3_model_dir):
    tok_path = Path(gemma3_model_dir) / "tokenizer.json"
    hf = Tokenizer.from_file(str(tok_path))
    for prompt in PROMPTS:
        text = f"<bos><start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"
        ids = encode(native_bins, tok_path, prompt, "gemma")
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert ids[:2] == [2, 105]
        # raw: the tokenizer's own BOS (its post-processor adds <bos>)
        assert encode(native_bins, tok_path, prompt, "0") == hf.encode(prompt, add_special_tokens=True).ids


@pytest.mark.real_model
def test_raw_text_is_encoded_as_the_tokenizer_does(native_bins, smollm2_model_dir, tiny_programs):
    """No BOS of the program's own where the tokenizer adds none (SmolLM2): HF's tokenizer, the Python runner and
    ExecuTorch's TextLLMRunner feed raw text that way, so `--chat 0` answers as they do."""
    tok_path = Path(smollm2_model_dir) / "tokenizer.json"
    hf = Tokenizer.from_file(str(tok_path))
    plain = hf.encode("Hello world", add_special_tokens=True).ids
    assert plain and plain[0] != 1  # SmolLM2's post-processor adds no BOS
    assert encode(native_bins, tok_path, "Hello world", "0") == plain
    assert encode(native_bins, tok_path, "Hello world", "0", "--pte", tiny_programs / "tiny_last.pte") == plain


def _with_specials(tmp_path: Path, specials: list[str]) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([s for s in make_corpus(200) if s], trainer)
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    path = tmp_path / "tok.json"
    tok.save(str(path))
    return path


@pytest.mark.parametrize("chat,specials,template", [
    ("llama3", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
     "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{p}<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("gemma4", ["<bos>", "<|turn>", "<turn|>"], "<bos><|turn>user\n{p}<turn|>\n<|turn>model\n"),
])
def test_other_templates(chat, specials, template, native_bins, tmp_path):
    path = _with_specials(tmp_path, specials)
    hf = Tokenizer.from_file(str(path))
    for prompt in PROMPTS:
        expected = hf.encode(template.replace("{p}", prompt), add_special_tokens=False).ids
        assert encode(native_bins, path, prompt, chat) == expected


def test_unknown_template(native_bins, tmp_path):
    path = _with_specials(tmp_path, ["<bos>"])
    proc = subprocess.run([str(native_bins[0]), "--tokenizer", str(path), "--prompt", "x", "--chat", "alpaca",
                           "--encode"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown chat template 'alpaca'" in proc.stderr
