"""A small byte-level BPE tokenizer for tiny random models, trained deterministically on a fixed text."""
from __future__ import annotations

from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 = pad, bos, eos of the random configs

_CORPUS = """The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the
capital of France. Write a haiku about the sea: waves fold into foam, salt wind carries gull voices,
the tide keeps its time. def main():\n    return 42\n  1234567890 numbers, commas; colons: and
question marks? Hello, world! Café, naïve, über, smörgåsbord. 東京 北京 こんにちは 😀 🚀
"""


def train(vocab_size: int, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)
