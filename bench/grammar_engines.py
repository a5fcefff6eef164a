"""Per-token mask time of the grammar engines on PyPI, over the real models' tokenizers: llguidance, xgrammar and
outlines-core (the engine pipeline/generation/constrain.py uses is the one with the lowest steady mask time that needs
no other package).

    python bench/grammar_engines.py                        # SmolLM2 (49,152 ids) and Gemma 3 (262,144 ids)
    python bench/grammar_engines.py --models smollm2

For each engine and tokenizer: the time to compile a JSON schema (SCHEMA below), the first mask (engines that build
their tables lazily pay it there), and the median mask time per token while it walks a valid output token by token
(the output's own tokens, from the model's tokenizer). Engines not installed are skipped with a note
(`pip install llguidance outlines-core`; xgrammar with --no-deps: it requires triton). Writes
outputs/bench/grammar_engines.json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from common import build, write_results

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "city", "tags"],
    "additionalProperties": False}
OUTPUT = '{"name": "Alice Martin", "age": 31, "city": "Paris", "tags": ["engineer", "runner", "chess"]}'
MODELS = {"smollm2": [], "gemma3": ["recipe=gemma3_offgraph"]}  # bench/speculate.py's builds


def llguidance_engine(hf, vocab):
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    compile_s = time.perf_counter() - t0
    mask = llt.allocate_token_bitmask(1, vocab)
    return compile_s, lambda: llt.fill_next_token_bitmask(m, mask, 0), lambda t: m.consume_token(t)


def xgrammar_engine(hf, vocab):
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    return compile_s, lambda: matcher.fill_next_token_bitmask(mask), lambda t: matcher.accept_token(t)


def outlines_engine(hf, vocab):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    t0 = time.perf_counter()
    eos = hf.eos_token_id
    tokens: dict = {}
    for text, i in hf.get_vocab().items():
        if i != eos and i < vocab:
            tokens.setdefault(hf.convert_tokens_to_string([text]) if text.startswith("Ġ") or "Ġ" in text else text,
                              []).append(i)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos, tokens))
    guide = Guide(index)
    compile_s = time.perf_counter() - t0
    return compile_s, lambda: guide.get_tokens(), lambda t: guide.advance(t)


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine, "outlines-core": outlines_engine}


def measure(hf, vocab: int) -> dict:
    ids = hf(OUTPUT, add_special_tokens=False)["input_ids"]
    out = {}
    for name, make in ENGINES.items():
        try:
            compile_s, mask, take = make(hf, vocab)
        except ImportError as e:
            out[name] = {"skipped": f"not installed ({e.name})"}
            continue
        except Exception as e:  # noqa: BLE001 - an engine that cannot take this tokenizer is a finding
            out[name] = {"skipped": f"{type(e).__name__}: {e}"[:200]}
            continue
        times = []
        try:
            for t in ids:
                t0 = time.perf_counter()
                mask()
                times.append(time.perf_counter() - t0)
                take(t)
        except Exception as e:  # noqa: BLE001 - e.g. a vocabulary it reads differently refuses the output's tokens
            out[name] = {"compile_ms": round(compile_s * 1e3, 1), "skipped": f"walk failed: {e}"[:160]}
            print(f"  {name}: {out[name]}", flush=True)
            continue
        out[name] = {"compile_ms": round(compile_s * 1e3, 1), "first_mask_ms": round(times[0] * 1e3, 2),
                     "mask_ms_per_token": round(statistics.median(times[1:]) * 1e3, 4), "tokens": len(ids)}
        print(f"  {name}: {out[name]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    args = ap.parse_args()
    from transformers import AutoTokenizer
    results = {}
    for name in args.models.split(","):
        m = build(MODELS[name])
        hf = AutoTokenizer.from_pretrained(m["model_dir"])
        from pipeline import abi
        vocab = json.loads(open(m["pte"].rsplit("/", 1)[0] + "/lower.json").read())["constant_methods"][
            abi.VOCAB_SIZE]
        print(f"{name}: vocabulary {vocab}", flush=True)
        results[name] = {"vocab": vocab, "engines": measure(hf, vocab)}
    print("\n| model (ids) | engine | compile ms | first mask ms | mask ms per token |\n|---|---|---|---|---|")
    for name, r in results.items():
        for engine, e in r["engines"].items():
            if "skipped" in e:
                print(f"| {name} ({r['vocab']}) | {engine} | {e['skipped']} | | |")
            else:
                print(f"| {name} ({r['vocab']}) | {engine} | {e['compile_ms']} | {e['first_mask_ms']} | "
                      f"{e['mask_ms_per_token']} |")
    write_results("grammar_engines", results)


if __name__ == "__main__":
    main()
