"""ensure_tokenizer on real checkpoint folders built offline: a processor-backed one (transformers' Gemma3Processor
around a tiny byte-level BPE tokenizer, as gemma-3/4 -it checkpoints ship), a plain tokenizer folder, and folders
with no tokenizer at all."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.model.checkpoint import ensure_tokenizer

# the chat template lives in the processor only: its tokenizer carries none
TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
GEMMA_SPECIALS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
TEXT = "Hello, world! The quick brown fox <start_of_image> jumps."
MESSAGES = [{"role": "user", "content": "Hello"}]


def tiny_tokenizer():
    """A fast tokenizer with Gemma 3's image tokens (Gemma3Processor reads them), trained offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", *GEMMA_SPECIALS.values()]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. Hello, world!"] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", extra_special_tokens=GEMMA_SPECIALS)
    assert fast.chat_template is None
    return fast


def processor_checkpoint(folder: Path, template_in: str):
    """Save a Gemma3Processor (PIL image processor, no torchvision needed) with the chat template where a hub
    checkpoint keeps it: `jinja` (chat_template.jinja, today's layout) or `processor_config` (its
    "chat_template" key, the older layout, which AutoTokenizer does not read). Returns the original tokenizer."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor
    tok = tiny_tokenizer()
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(), tokenizer=tok, chat_template=TEMPLATE,
                    image_seq_length=4).save_pretrained(folder)
    assert (folder / "processor_config.json").exists() and (folder / "chat_template.jinja").exists()
    if template_in == "processor_config":
        cfg = json.loads((folder / "processor_config.json").read_text())
        cfg["chat_template"] = (folder / "chat_template.jinja").read_text()
        (folder / "processor_config.json").write_text(json.dumps(cfg, indent=2))
        (folder / "chat_template.jinja").unlink()
    return tok


def test_processor_template_reaches_the_saved_tokenizer(tmp_path):
    from transformers import AutoProcessor, AutoTokenizer
    original = processor_checkpoint(tmp_path, "processor_config")
    # the folder as found: AutoTokenizer loads no template, the processor has it
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template is None
    assert AutoProcessor.from_pretrained(tmp_path).chat_template == TEMPLATE

    assert ensure_tokenizer(tmp_path) == {"tokenizer_from": "processor"}
    assert (tmp_path / "tokenizer.json").exists()
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.chat_template == TEMPLATE
    assert tok.encode(TEXT) == original.encode(TEXT)
    assert original.convert_tokens_to_ids("<start_of_image>") in tok.encode(TEXT)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == \
        "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"


def test_processor_folder_with_chat_template_jinja_is_read_by_autotokenizer(tmp_path):
    from transformers import AutoTokenizer
    original = processor_checkpoint(tmp_path, "jinja")
    assert ensure_tokenizer(tmp_path) == {"tokenizer_from": "tokenizer"}
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.chat_template == TEMPLATE
    assert tok.encode(TEXT) == original.encode(TEXT)


def test_plain_tokenizer_folder_is_left_alone(tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path)
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir()}
    assert "tokenizer.json" in before and "processor_config.json" not in before
    assert ensure_tokenizer(tmp_path) == {}
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir()} == before


@pytest.mark.parametrize("model_type", [None, "llama", "gemma3_text", "qwen2"])
def test_no_tokenizer_and_no_processor_raises(tmp_path, model_type):
    # a weights-only folder (config.json): transformers 5 builds a specials-only Gemma / Qwen2 tokenizer from it
    if model_type:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(RuntimeError, match="neither AutoTokenizer nor AutoProcessor loads a tokenizer"):
        ensure_tokenizer(tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()
