"""Our C++ runner vs llama.cpp vs HF transformers eager, on the same model, prompt and thread count
(a benchmark, not a test).

    pip install -e ".[bench]"            # llama-cpp-python (compiles llama.cpp, a few minutes)
    python bench/compare.py              # both models, 3 alternating rounds, 2 threads
    python bench/compare.py --models smollm2 --rounds 5 --prompt-tokens 400 --new-tokens 128

Engines, each in its own process per run (so peak RSS is its own), alternating within each round:
- ours: llm_runner on the pipeline's best recipe for the model (built through the stage cache),
- llama.cpp: llama-cpp-python on the very GGUF file the model came from,
- eager: HF transformers on the dequantized model (fp32, HF's own cache).
All get the same prompt token ids and generate greedily with end-of-sequence ignored. Prints medians of
prefill tok/s, decode tok/s, time to first token and peak RSS, and the ratios ours/llama.cpp and
ours/eager; writes outputs/bench/latest.json.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, build, gguf_file  # noqa: E402  (bench/ is the script's folder)

# the best recipe per model (smallest and fastest that still verifies)
BEST = {"smollm2": ["recipe=smollm2_custom"], "gemma3": ["recipe=gemma3_offgraph_8da4w"]}
TEXT = ("The history of the printing press begins in the fifteenth century, when movable type made books "
        "cheaper to produce and easier to share. Within a few decades, printers across Europe were "
        "publishing bibles, grammars, calendars and pamphlets, and the number of readers grew with them. ")
ENGINES = ("ours", "llama.cpp", "eager")


# --------------------------------------------------------------------------------------------------
# workers (one process per run)
# --------------------------------------------------------------------------------------------------
def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def work_llama_cpp(gguf: str, ids: list[int], new: int, threads: int) -> dict:
    import numpy as np
    from llama_cpp import Llama
    llm = Llama(model_path=gguf, n_ctx=len(ids) + new + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)
    llm.eval(ids[:8])  # warm-up, then start over
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    n_vocab = llm.n_vocab()

    def last_logits():  # without logits_all, llama-cpp-python leaves Llama.scores unfilled: read the context's
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    out = []
    for _ in range(new):
        tok = int(np.argmax(last_logits()))
        out.append(tok)
        llm.eval([tok])
    t2 = time.perf_counter()
    return {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": new / (t2 - t1),
            "ttft_ms": (t1 - t0) * 1000, "peak_rss_mib": peak_rss_mib(), "generated_ids": out}


def work_eager(model_dir: str, ids: list[int], new: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        model(torch.tensor([ids[:8]]))  # warm-up
        t0 = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        t1 = time.perf_counter()
        cache, logits, gen = out.past_key_values, out.logits[0, -1], []
        for i in range(new):
            tok = int(logits.argmax())
            gen.append(tok)
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1]
        t2 = time.perf_counter()
    return {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": new / (t2 - t1),
            "ttft_ms": (t1 - t0) * 1000, "peak_rss_mib": peak_rss_mib(), "generated_ids": gen}


def run_ours(m: dict, ids: list[int], new: int, threads: int) -> dict:
    from pipeline import native
    extra = ["--ignore-eos", "--warmup", "--threads", str(threads), *native.cache_args(m)]
    s = native.run(m["pte"], m["tokenizer"], prompt_ids=ids, max_new_tokens=new, extra_args=extra)
    return {k: s[k] for k in ("prefill_tok_s", "decode_tok_s", "ttft_ms", "peak_rss_mib", "generated_ids")}


def run_worker(engine: str, source: str, ids: list[int], new: int, threads: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--worker", engine, "--source", source, "--ids",
                        ",".join(map(str, ids)), "--new-tokens", str(new), "--threads", str(threads)],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{engine} worker failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------
# setup: the pipeline build, the GGUF file, the prompt
# --------------------------------------------------------------------------------------------------
def prompt_ids(m: dict, n: int) -> list[int]:
    from pipeline import native
    ids, text = [], TEXT
    while len(ids) < n:
        ids = native.encode(m["tokenizer"], text, "0", pte=m["pte"])
        text += TEXT
    return ids[:n]


def med(rs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", choices=("llama.cpp", "eager"), help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        ids = [int(x) for x in a.ids.split(",")]
        fn = work_llama_cpp if a.worker == "llama.cpp" else work_eager
        print(json.dumps(fn(a.source, ids, a.new_tokens, a.threads)))
        return
    engines = a.engines.split(",")
    if "llama.cpp" in engines:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            sys.exit("llama.cpp needs llama-cpp-python: pip install -e '.[bench]' (or --engines ours,eager)")
    latest = {"threads": a.threads, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
              "rounds": a.rounds, "models": {}}
    for model in a.models.split(","):
        m = build(BEST[model])
        ids = prompt_ids(m, a.prompt_tokens)
        sources = {"ours": None, "llama.cpp": str(gguf_file(m)), "eager": m["model_dir"]}
        runs: dict[str, list[dict]] = {e: [] for e in engines}
        for r in range(a.rounds):
            for e in engines:
                runs[e].append(run_ours(m, ids, a.new_tokens, a.threads) if e == "ours"
                               else run_worker(e, sources[e], ids, a.new_tokens, a.threads))
            print(f"[{model}] round {r + 1}/{a.rounds}", flush=True)
        rows = {e: {k: med(rs, k) for k in ("prefill_tok_s", "decode_tok_s", "ttft_ms", "peak_rss_mib")}
                for e, rs in runs.items()}
        if "eager" in runs:  # a sanity check that every engine ran the same model: leading greedy agreement
            ref = runs["eager"][0]["generated_ids"]
            for e in rows:
                got = runs[e][0]["generated_ids"]
                rows[e]["leading_tokens_equal_eager"] = next((i for i, (x, y) in enumerate(zip(got, ref)) if x != y),
                                                             min(len(got), len(ref)))
        ratios = {}
        if "ours" in rows:
            for other in (e for e in rows if e != "ours"):
                ratios[f"ours/{other}"] = {k: rows["ours"][k] / rows[other][k] for k in ("prefill_tok_s", "decode_tok_s")}
        latest["models"][model] = {"recipe": m["recipe"], "pte": m["pte"], "gguf": sources["llama.cpp"],
                                   "engines": rows, "ratios": ratios}
        print(f"\n{model} ({' '.join(BEST[model])}; GGUF {Path(sources['llama.cpp']).name}): prompt {len(ids)} tokens, "
              f"{a.new_tokens} new, {a.threads} threads for every engine, medians of {a.rounds} alternating rounds")
        print(f"  {'engine':<10} {'prefill tok/s':>13} {'decode tok/s':>12} {'TTFT ms':>9} {'peak RSS MiB':>12} "
              f"{'= eager tokens':>14}")
        for e, row in rows.items():
            print(f"  {e:<10} {row['prefill_tok_s']:>13.1f} {row['decode_tok_s']:>12.1f} {row['ttft_ms']:>9.1f} "
                  f"{row['peak_rss_mib']:>12.0f} {row.get('leading_tokens_equal_eager', '-'):>14}")
        for name, rr in ratios.items():
            print(f"  {name:<16} prefill x{rr['prefill_tok_s']:.2f}  decode x{rr['decode_tok_s']:.2f}")
    out = ROOT / "outputs" / "bench" / "latest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(latest, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
