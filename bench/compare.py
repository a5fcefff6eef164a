"""Our C++ runner vs llama.cpp on the same model: the package's GGUF and its Q4_0 requantization (llama.cpp's
fastest x86 format, the anchor), at 1 and 2 threads (a benchmark, not a test).

    pip install -e ".[bench]"            # llama-cpp-python (compiles llama.cpp, a few minutes; on a machine whose
                                         # CPU reports AMX but faults on it, see NO_AMX below)
    python bench/compare.py              # both models, 3 alternating rounds, 1 and 2 threads
    python bench/compare.py --models smollm2 --threads 2 --rounds 5
    python bench/compare.py --engines ours,eager          # without llama.cpp

Scenarios, llama-bench style, every engine given the same token ids and decoding greedily with EOS ignored:
- pp512: prefill of a 512-token prompt (the recipe's context permitting: pp<n> names what ran);
- tg128: 128 tokens decoded from a 1-token prompt;
- d16 / deep: 64 tokens decoded after a 16-token prompt, and after a prompt that fills the recipe's context
  up to those 64 (the deepest decode the program allows: SmolLM2 ~450-512 positions, gemma3 ~960-1024);
  deep/d16 is how much decode speed survives depth.
Engines, each run in its own process (so peak RSS is its own), alternating within each round:
- ours: llm_runner on the model's best recipe (built through the stage cache; BEST),
- ours-matched: llm_runner on the fastest build whose KLD against the float model is at most Q4_0's (MATCHED):
  the same speed question at no worse fidelity,
- llama.cpp: llama-cpp-python on the GGUF file the model came from,
- llama.cpp-q4_0: the same GGUF requantized to Q4_0 (llama_model_quantize, requantize allowed; cached in
  outputs/bench/gguf/),
- eager: HF transformers on the dequantized model (fp32, HF's own cache; off by default, slow).
Prints medians per scenario and the ratios of each of ours to llama.cpp-q4_0 (and to llama.cpp); writes
outputs/bench/latest.json, whose `ratios` are against llama.cpp's fastest format.
"""
from __future__ import annotations

import argparse
import json
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, build, gguf_file, write_results  # noqa: E402  (bench/ is the script's folder)

# the best recipe per model (smallest and fastest that still verifies)
BEST = {"smollm2": ["recipe=smollm2_custom_fp16kv"], "gemma3": ["recipe=gemma3_offgraph_8da4w"]}
# the fastest build whose KLD against the float model is at most the anchor's (bench/fidelity.py, docs/fidelity.md):
# smoothed 8da4w linears with an 8-bit embedding; the lm_head 8-bit (SmolLM2: 0.185 vs Q4_0's 0.249; at 4 bits it
# is 0.323) or 8da4w in groups of 32 (gemma3: 0.344 vs 0.423). BEST's 4-bit embedding = lm_head sits further away
# (0.52, 0.57): llama.cpp's Q4_0 keeps the tied embedding at 6 bits (Q6_K).
MATCHED = {"smollm2": ["recipe=smollm2_custom_fp16kv", "quantize=8da4w_mixed", "quantize.overrides=[]"],
           "gemma3": ["recipe=gemma3_offgraph_8da4w", "quantize=8da4w_mixed", "quantize.overrides=[]",
                      "quantize.lm_head=8da4w", "quantize.lm_head_group_size=32"]}
TEXT = ("The history of the printing press begins in the fifteenth century, when movable type made books "
        "cheaper to produce and easier to share. Within a few decades, printers across Europe were "
        "publishing bibles, grammars, calendars and pamphlets, and the number of readers grew with them. ")
ENGINES = ("ours", "ours-matched", "llama.cpp", "llama.cpp-q4_0", "eager")
DEFAULT_ENGINES = ("ours", "ours-matched", "llama.cpp", "llama.cpp-q4_0")
OURS = {"ours": BEST, "ours-matched": MATCHED}  # engine -> its builds
ANCHOR = "llama.cpp-q4_0"
Q4_0 = 2  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_0
DECODE = 64  # tokens decoded in the depth scenarios
# llama.cpp's ggml options for the instruction sets /proc/cpuinfo lists, AMX left off (GGML_NATIVE would turn AMX on
# where the CPU reports it, and faults where a VM does not let a process use it); an option for a set the CPU lacks
# (AVX-VNNI on AMD's Zen 4, say) faults the same way
GGML_FLAGS = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx_vnni": "AVX_VNNI",
              "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
              "avx512_bf16": "AVX512_BF16"}


def _no_amx() -> str:
    try:
        cpu = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                       if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        cpu = set()
    return " ".join(["-DGGML_NATIVE=OFF"] + [f"-DGGML_{opt}={'ON' if flag in cpu else 'OFF'}"
                                            for flag, opt in GGML_FLAGS.items()])


NO_AMX = _no_amx()


def scenarios(context: int) -> dict[str, tuple[int, int]]:
    """name -> (prompt tokens, new tokens) within the program's context."""
    pp = min(512, context - 2)
    return {f"pp{pp}": (pp, 1), "tg128": (1, 128), "d16": (16, DECODE), "deep": (context - DECODE - 1, DECODE)}


# --------------------------------------------------------------------------------------------------
# workers (one process per engine and round: every scenario in it, one model load)
# --------------------------------------------------------------------------------------------------
def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def work_llama_cpp(gguf: str, jobs: dict, threads: int) -> dict:
    import numpy as np
    from llama_cpp import Llama
    n_ctx = max(len(ids) + new for ids, new in jobs.values()) + 8
    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)
    n_vocab = llm.n_vocab()

    def last_logits():  # without logits_all, llama-cpp-python leaves Llama.scores unfilled: read the context's
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    llm.eval(list(jobs.values())[0][0][:8])  # warm-up
    out = {}
    for name, (ids, new) in jobs.items():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        gen = []
        for _ in range(new):
            tok = int(np.argmax(last_logits()))
            gen.append(tok)
            if len(gen) < new:
                llm.eval([tok])
        t2 = time.perf_counter()
        out[name] = {"prefill_tok_s": len(ids) / (t1 - t0), "ttft_ms": (t1 - t0) * 1000,
                     "decode_tok_s": (new - 1) / (t2 - t1) if new > 1 else None, "generated_ids": gen}
    return {"scenarios": out, "peak_rss_mib": peak_rss_mib()}


def work_eager(model_dir: str, jobs: dict, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        model(torch.tensor([list(jobs.values())[0][0][:8]]))  # warm-up
        for name, (ids, new) in jobs.items():
            t0 = time.perf_counter()
            res = model(torch.tensor([ids]), use_cache=True)
            t1 = time.perf_counter()
            cache, logits, gen = res.past_key_values, res.logits[0, -1], []
            for _ in range(new):
                tok = int(logits.argmax())
                gen.append(tok)
                if len(gen) < new:
                    res = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
                    cache, logits = res.past_key_values, res.logits[0, -1]
            t2 = time.perf_counter()
            out[name] = {"prefill_tok_s": len(ids) / (t1 - t0), "ttft_ms": (t1 - t0) * 1000,
                         "decode_tok_s": (new - 1) / (t2 - t1) if new > 1 else None, "generated_ids": gen}
    return {"scenarios": out, "peak_rss_mib": peak_rss_mib()}


def run_ours(m: dict, jobs: dict, threads: int) -> dict:
    from pipeline import native
    out, peak = {}, 0.0
    for name, (ids, new) in jobs.items():
        extra = ["--ignore-eos", "--warmup", "--threads", str(threads), *native.cache_args(m)]
        s = native.run(m["pte"], m["tokenizer"], prompt_ids=ids, max_new_tokens=new, extra_args=extra)
        out[name] = {"prefill_tok_s": s["prefill_tok_s"], "ttft_ms": s["ttft_ms"],
                     "decode_tok_s": s["decode_tok_s"] if new > 1 else None, "generated_ids": s["generated_ids"]}
        peak = max(peak, s["peak_rss_mib"])
    return {"scenarios": out, "peak_rss_mib": peak}


def run_worker(engine: str, source: str, jobs: dict, threads: int) -> dict:
    spec = json.dumps({name: [ids, new] for name, (ids, new) in jobs.items()})
    r = subprocess.run([sys.executable, __file__, "--worker", engine, "--source", source, "--threads", str(threads)],
                       input=spec, capture_output=True, text=True, timeout=3600)
    if r.returncode == -signal.SIGILL:
        raise RuntimeError(f"{engine} worker: illegal instruction. llama.cpp was built for instructions this machine "
                           f"does not run (AMX tiles a VM withholds, or AVX-VNNI on AMD Zen 4): reinstall it with "
                           f"CMAKE_ARGS=\"{NO_AMX}\" pip install --force-reinstall --no-deps --no-cache-dir "
                           f"llama-cpp-python==0.3.36")
    if r.returncode != 0:
        raise RuntimeError(f"{engine} worker failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------
# setup: the pipeline build, the GGUF files, the prompts
# --------------------------------------------------------------------------------------------------
def q4_0_file(gguf: Path) -> Path:
    """The GGUF requantized to Q4_0 (once; outputs/bench/gguf/<name>-q4_0.gguf)."""
    import llama_cpp
    out = ROOT / "outputs" / "bench" / "gguf" / f"{gguf.stem}-q4_0.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = Q4_0
        params.allow_requantize = True
        tmp = out.with_suffix(".tmp.gguf")
        if llama_cpp.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), params) != 0:
            sys.exit(f"llama_model_quantize failed on {gguf}")
        tmp.replace(out)
    return out


def prompt_ids(m: dict, n: int) -> list[int]:
    from pipeline import native
    ids, text = [], TEXT
    while len(ids) < n:
        ids = native.encode(m["tokenizer"], text, "0", pte=m["pte"])
        text += TEXT
    return ids[:n]


def med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--engines", default=",".join(DEFAULT_ENGINES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts, the same for every engine")
    ap.add_argument("--worker", choices=("llama.cpp", "eager"), help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        jobs = {k: (ids, new) for k, (ids, new) in json.loads(sys.stdin.read()).items()}
        fn = work_llama_cpp if a.worker == "llama.cpp" else work_eager
        print(json.dumps(fn(a.source, jobs, int(a.threads))))
        return
    engines = a.engines.split(",")
    if any(e.startswith("llama.cpp") for e in engines):
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            sys.exit("llama.cpp needs llama-cpp-python: pip install -e '.[bench]' (or --engines ours,eager)")
    thread_counts = [int(t) for t in a.threads.split(",")]
    latest = {"threads": thread_counts, "rounds": a.rounds, "anchor": ANCHOR, "models": {}}
    for model in a.models.split(","):
        builds = {e: build(OURS[e][model]) for e in engines if e in OURS}
        m = next(iter(builds.values())) if builds else build(BEST[model])  # context, tokenizer, GGUF: any of ours
        context = m["config"]["export"]["max_context_len"]
        plan = scenarios(context)
        longest = prompt_ids(m, max(p for p, _ in plan.values()))
        jobs = {name: (longest[:p], new) for name, (p, new) in plan.items()}
        sources = {"llama.cpp": str(gguf_file(m)), "eager": m["model_dir"]}
        if ANCHOR in engines:
            sources[ANCHOR] = str(q4_0_file(Path(sources["llama.cpp"])))
        rows: dict = {}
        for threads in thread_counts:
            runs: dict[str, list[dict]] = {e: [] for e in engines}
            for r in range(a.rounds):
                for e in engines:
                    runs[e].append(run_ours(builds[e], jobs, threads) if e in OURS else
                                   run_worker("eager" if e == "eager" else "llama.cpp", sources[e], jobs, threads))
                print(f"[{model}] {threads} thread(s), round {r + 1}/{a.rounds}", flush=True)
            for e, rs in runs.items():
                row = {"peak_rss_mib": med([x["peak_rss_mib"] for x in rs])}
                for name in plan:
                    key = "prefill_tok_s" if name.startswith("pp") else "decode_tok_s"
                    row[name] = med([x["scenarios"][name][key] for x in rs])
                row["ttft_ms"] = med([x["scenarios"][next(iter(plan))]["ttft_ms"] for x in rs])
                row["deep/d16"] = row["deep"] / row["d16"] if row["deep"] and row["d16"] else None
                rows[f"{e} t{threads}"] = row
        ratios = {}
        for threads in thread_counts:
            for e in (e for e in engines if e in OURS):
                for other in (o for o in engines if o not in OURS):
                    ours, them = rows[f"{e} t{threads}"], rows[f"{other} t{threads}"]
                    ratios[f"{e}/{other} t{threads}"] = {k: ours[k] / them[k] for k in plan if ours[k] and them[k]}
        latest["models"][model] = {"recipe": m["recipe"], "pte": m["pte"], "context": context,
                                   "builds": {e: {"overrides": OURS[e][model], "pte": b["pte"]}
                                              for e, b in builds.items()},
                                   "scenarios": {k: {"prompt": p, "new": n} for k, (p, n) in plan.items()},
                                   "gguf": sources, "engines": rows, "ratios": ratios}
        names = list(plan)
        print(f"\n{model} (" + "; ".join(f"{e}: {' '.join(OURS[e][model])}" for e in builds) +
              f", context {context}; GGUF {Path(sources['llama.cpp']).name}): "
              f"tok/s, medians of {a.rounds} alternating rounds; {', '.join(f'{k} = {p} + {n}' for k, (p, n) in plan.items())}")
        print(f"  {'engine':<22}" + "".join(f"{n:>9}" for n in names) + f"{'deep/d16':>9}{'TTFT ms':>9}{'RSS MiB':>9}")
        for name, row in rows.items():
            print(f"  {name:<22}" + "".join(f"{fmt(row[n]):>9}" for n in names) +
                  f"{row['deep/d16'] or 0:>9.2f}{fmt(row['ttft_ms']):>9}{row['peak_rss_mib']:>9.0f}")
        for name, rr in ratios.items():
            print(f"  {name:<30}" + "  ".join(f"{k} x{v:.2f}" for k, v in rr.items()))
    write_results("latest", latest)


if __name__ == "__main__":
    main()
