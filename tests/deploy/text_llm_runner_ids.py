"""Greedy generation in ExecuTorch's own runner (TextLLMRunner, its Python bindings), in a process of its own, as an
app would run a program: `pipeline.ops.load()`, then the runner on the .pte and its tokenizer.json.

    python tests/deploy/text_llm_runner_ids.py PTE TOKENIZER_JSON PROMPT MAX_NEW_TOKENS OUT_JSON

Writes {"prompt_ids", "generated_ids", "text"}. The runner hands back text pieces, not ids, and a byte-level piece
that is not UTF-8 alone cannot cross into Python: it runs on a copy of the tokenizer without its decoder, so each piece
is the token's own vocabulary string, which maps back to its id. The decoder never changes which token is chosen.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def main(pte: str, tokenizer: str, prompt: str, max_new: int, out: str) -> None:
    from pipeline import ops
    ops.load()
    import pytorch_tokenizers
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    spec = json.loads(Path(tokenizer).read_text())
    spec["decoder"] = None
    ids_of = {s: i for s, i in spec["model"]["vocab"].items()} | {a["content"]: a["id"] for a in spec["added_tokens"]}
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "tokenizer.json"
        raw.write_text(json.dumps(spec))
        tok = pytorch_tokenizers.CppHFTokenizer()
        tok.load(str(raw))
        prompt_ids = list(tok.encode(prompt, 0, 0))  # what the runner feeds (GenerationConfig: num_bos=0, num_eos=0)
        pieces: list[str] = []
        runner = TextLLMRunner(pte, str(raw))
        runner.generate(prompt, GenerationConfig(max_new_tokens=max_new, temperature=0.0, echo=False),
                        token_callback=pieces.append)
    generated = [ids_of[p] for p in pieces]
    Path(out).write_text(json.dumps({"prompt_ids": prompt_ids, "generated_ids": generated,
                                     "text": "".join(pieces)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
