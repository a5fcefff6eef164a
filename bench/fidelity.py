"""How far each build sits from the float model on six held-out domains, beside llama.cpp's formats of the same source.

    python bench/fidelity.py                                  # both models, every row below (hours cold)
    python bench/fidelity.py --models smollm2 --chunks 2      # one model, half the tokens
    python bench/fidelity.py --no-llama-cpp                   # our builds only
    python bench/fidelity.py --speed --plot                   # + decode tok/s of each row, and the frontier picture
    python bench/fidelity.py --speed-only --plot              # decode tok/s of the last results' rows again
    python bench/fidelity.py --plot-only                      # the picture of the last results, measuring nothing

The domains (bench/corpus/README.md; pipeline/corpus.py): narrative, French, chat turns through the chat template,
code, legal and technical prose. None is in the calibration set, and scoring is refused while one shares a line
with it. Each domain gives --chunks chunks of --ctx tokens, the second half of each scored (pipeline/fidelity.py,
the form of llama-perplexity --kl-divergence): KLD of the engine's next-token distribution against the float
model's (the GGUF dequantized by transformers, fp32) on the same tokens, and same top-1 %, per domain; a row's mean
over the domains and its worst domain.
- ours: the built program in its runtime, stepped token by token as a decode runs (not the eager module);
- llama.cpp (`pip install -e ".[bench]"`): the model's own GGUF, and requantizations of it (Q8_0, Q4_0, Q4_K_M,
  Q5_K_M, Q6_K) through llama_model_quantize with requantize allowed, all scored on the same token ids.
bits_per_weight: the file's bytes x 8 / the model's parameters (a tied embedding counts once, as the model holds it).
--speed: decode tok/s at 2 threads after the same 400-token prompt (100 tokens, greedy, EOS ignored): ours in the C++
runner, llama.cpp through llama-cpp-python, each in a process of its own, the median of 5 rounds that run every row
once (with --speed-only, --only NAME,NAME limits our rows; llama.cpp's are timed beside them). --plot: KLD on the
worst domain against bits/weight, one point a row, decode speed as the colour, both models
(outputs/bench/fidelity.png; docs/img/frontier.png with --docs).
Writes outputs/bench/fidelity.json and prints one Markdown table per model.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from common import ROOT, build, gguf_file

# per model: row name -> pipeline overrides (our own builds)
DOWN_8BIT = "+quantize.overrides=[{pattern:'*.mlp.down_proj',scheme:8da8w,group_size:0}]"
# the embedding at 8 bits in groups of 32 holds the file's Q8_0 grid: carried, not re-quantized
HEAD_8BIT = ["quantize.embedding=8w", "quantize.embedding_group_size=32", "quantize.source_grid=true",
             "quantize.lm_head=8da8w"]
# 4-bit linears after smoothing, the embedding 8-bit per row and re-tied as the lm_head
SMOOTH_4BIT = ["quantize=8da4w_mixed", "quantize.overrides=[]"]
GPTQ = ["quantize.algorithm=gptq"]
# the previous default: HQQ scales after smoothing, only down_proj at 8 bits, no calibration
MIXED = ["quantize=8da4w_mixed"]
# the allocator free to place every linear (no override pins down_proj)
AUTO = ["quantize.overrides=[]"]
# the lm_head alone at 4 bits in groups of 32 (its own copy; the embedding stays 8-bit): a decoded token reads the
# head whole and the embedding one row, so the head's bits are the ones that cost speed
HEAD_4BIT = ["quantize.lm_head=8da4w", "quantize.lm_head_group_size=32"]
BUILDS = {
    "smollm2": {
        "default (python -m pipeline): 8da4w smoothed, GPTQ, k + v + down 8da8w (quantize=8da4w_gptq)": [],
        "8da4w_gptq, K/V in fp16 (smollm2_gptq)": ["recipe=smollm2_gptq"],
        "8da4w_gptq, the allocator's plan at 6.25 pinned, K/V in fp16 (smollm2_planned)": ["recipe=smollm2_planned"],
        "auto at 6.25 bits (quantize.target_bpw=6.25, gptq)": [*GPTQ, *AUTO, "quantize.target_bpw=6.25"],
        "8da4w hqq smoothed + down_proj 8da8w, 8-bit embedding = lm_head (quantize=8da4w_mixed)": MIXED,
        "8da4w_mixed with GPTQ (quantize.algorithm=gptq)": [*MIXED, *GPTQ],
        "8da4w_mixed, the tied table copied into XNNPACK's payload (export.store_tied_once=false)": [
            *MIXED, "export.store_tied_once=false"],
        "8da4w_mixed without smoothing (quantize.smoothing=null)": [*MIXED, "quantize.smoothing=null"],
        "8da4w_mixed with GPTQ, without smoothing": [*MIXED, *GPTQ, "quantize.smoothing=null"],
        "auto at 6.15 bits (quantize.target_bpw=6.15, gptq)": [*GPTQ, *AUTO, "quantize.target_bpw=6.15"],
        "auto at 6.0 bits (quantize.target_bpw=6.0, gptq)": [*GPTQ, *AUTO, "quantize.target_bpw=6.0"],
        "auto at 5.0 bits (quantize.target_bpw=5.0, gptq)": [*GPTQ, *AUTO, "quantize.target_bpw=5.0"],
        "8da4w hqq smoothed, 8-bit embedding = lm_head": ["recipe=smollm2_custom", *SMOOTH_4BIT],
        "8da4w hqq smoothed, 8-bit embedding, 8da4w lm_head": ["recipe=smollm2_custom", *SMOOTH_4BIT, *HEAD_4BIT],
        "fp32": ["recipe=smollm2_custom", "quantize=none"],
        "8da4w, 4w embedding (smollm2_custom)": ["recipe=smollm2_custom"],
        "8da4w, 4w embedding, fp16 K/V (cache.kv_dtype=fp16)": ["recipe=smollm2_custom", "cache.kv_dtype=fp16"],
        "8da4w, 8-bit embedding + lm_head": ["recipe=smollm2_custom", *HEAD_8BIT],
        "8da4w hqq, 8-bit embedding + lm_head": ["recipe=smollm2_custom", *HEAD_8BIT, "quantize.algorithm=hqq"],
        "8da4w hqq, 8-bit embedding + lm_head + down_proj": ["recipe=smollm2_custom", *HEAD_8BIT,
                                                             "quantize.algorithm=hqq", DOWN_8BIT],
        "8da8w, 8-bit embedding": ["recipe=smollm2_custom", "quantize.linear=8da8w", "quantize.linear_group_size=0",
                                   "quantize.embedding=8w", "quantize.embedding_group_size=32",
                                   "quantize.source_grid=true"],
        "8w weight-only per channel, 8-bit embedding = lm_head": ["recipe=smollm2_custom", "quantize=8w"],
        "8w hqq weight-only per channel, 8-bit embedding = lm_head (smollm2_8w_hqq)": ["recipe=smollm2_8w_hqq"],
        "8w gptq weight-only per channel, 8-bit embedding = lm_head (smollm2_8w_gptq)": ["recipe=smollm2_8w_gptq"],
        "8da8w hqq smoothed, 8-bit embedding = lm_head, K/V in fp16": [
            *MIXED, "quantize.linear=8da8w", "quantize.linear_group_size=0", "quantize.overrides=[]", "cache.kv_dtype=fp16"],
        "MLX 4w, the file's Q4_1 + Q8_0 grid carried (llama_mlx_int4)": [
            "recipe=llama_mlx_int4", "quantize.embedding=8w", "quantize.lm_head=8w", "quantize.lm_head_group_size=32",
            "quantize.source_grid=true"],
    },
    "gemma3": {
        "8da4w hqq smoothed + down_proj 8da8w, 8-bit embedding = lm_head (quantize=8da4w_mixed)": [
            "recipe=gemma3_offgraph_8da4w", "quantize=8da4w_mixed"],
        "8da4w_mixed, the tied table copied into XNNPACK's payload (export.store_tied_once=false)": [
            "recipe=gemma3_offgraph_8da4w", "quantize=8da4w_mixed", "export.store_tied_once=false"],
        "8da4w_mixed with GPTQ": ["recipe=gemma3_offgraph_8da4w", "quantize=8da4w_mixed", *GPTQ],
        "GPTQ, k + v + down 8da8w (quantize=8da4w_gptq)": ["recipe=gemma3_offgraph_8da4w", "quantize=8da4w_gptq"],
        "8da4w hqq smoothed, 8-bit embedding = lm_head": ["recipe=gemma3_offgraph_8da4w", *SMOOTH_4BIT],
        "8da4w hqq smoothed, 8-bit embedding, 8da4w lm_head": ["recipe=gemma3_offgraph_8da4w", *SMOOTH_4BIT,
                                                              *HEAD_4BIT],
        "8da4w, 4w embedding (gemma3_offgraph_8da4w)": ["recipe=gemma3_offgraph_8da4w"],
        "8w hqq weight-only per channel, 8-bit embedding = lm_head": ["recipe=gemma3_offgraph_8da4w", "quantize=8w",
                                                                      "quantize.algorithm=hqq"],
    },
}
# llama.cpp's file types (llama_ftype) for llama_model_quantize
LLAMA_FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
SPEED_PROMPT, SPEED_NEW, SPEED_ROUNDS = 400, 100, 5


def requantized(src: Path, name: str, ftype: str) -> Path:
    """A requantization of a GGUF (llama.cpp's quantize, requantize allowed), made once under outputs/bench/gguf/."""
    import llama_cpp
    out = ROOT / "outputs" / "bench" / "gguf" / f"{name}-{ftype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = LLAMA_FTYPES[ftype]
        params.allow_requantize = True
        tmp = out.with_suffix(".tmp.gguf")
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize {src} -> {ftype} failed")
        tmp.replace(out)
    return out


def llama_files(first: dict, model: str) -> dict[str, Path]:
    """llama.cpp's rows: the model's own GGUF and its requantizations (LLAMA_FTYPES)."""
    src = gguf_file(first)
    return {"own file": src, **{t: requantized(src, model, t) for t in LLAMA_FTYPES}}


def llama_engine(path: Path, n_ctx: int, threads: int):
    """llama.cpp's logits at [first, n - 1) of a chunk (logits_all: every evaluated token keeps its row)."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=threads,
                verbose=False)

    def run(chunk, first):
        llm.reset()
        llm.eval(chunk)
        return torch.from_numpy(llm.scores[first:len(chunk) - 1].copy())
    return run


def program_engine(manifest: dict):
    from pipeline.fidelity import program_logits
    from pipeline.runtimes import open_program
    lower = next(Path(s["path"]) for s in manifest["stages"] if s["name"] == "lower")
    program = open_program(lower)
    return lambda chunk, first: program_logits(program, chunk, first, program.chunk)


def measure(model: str, args) -> list[dict]:
    from transformers import AutoTokenizer

    from pipeline.corpus import heldout_chunks
    from pipeline.fidelity import corpus_chunks, hf_logits, score
    from pipeline.model.loading import load_hf_model
    only = args.only.split(",") if args.only else None
    builds = {name: build(ov) for name, ov in BUILDS[model].items() if not only or any(o in name for o in only)}
    first = next(iter(builds.values()))
    hf = load_hf_model(first["model_dir"])
    params = sum(p.numel() for p in hf.parameters())
    tok = AutoTokenizer.from_pretrained(first["model_dir"])
    domains = heldout_chunks(tok, args.ctx, args.chunks)
    engines, rows = {}, {}
    for name, m in builds.items():
        engines[name] = program_engine(m)
        rows[name] = {"engine": "ours", "build": name, "overrides": BUILDS[model][name],
                      "bits_per_weight": Path(m["pte"]).stat().st_size * 8 / params}
    files = {} if args.no_llama_cpp else llama_files(first, model)
    for name, path in files.items():
        key = f"llama.cpp {name}"
        engines[key] = llama_engine(path, args.ctx, args.threads)
        rows[key] = {"engine": "llama.cpp", "build": name, "bits_per_weight": path.stat().st_size * 8 / params}
    if args.speed:
        ids = [i for c in corpus_chunks(tok, args.ctx, 1) for i in c][:SPEED_PROMPT]
        jobs = {**{name: ("ours", m) for name, m in builds.items()},
                **{f"llama.cpp {name}": ("llama.cpp", path) for name, path in files.items()}}
        for key, tok_s in decode_speeds(jobs, ids, args.threads).items():
            rows[key]["decode_tok_s"] = tok_s
    t0 = time.perf_counter()
    figures = {name: {} for name in engines}
    for domain, chunks in domains.items():
        got = score(lambda chunk: hf_logits(hf, chunk), engines, chunks,
                    progress=lambda xs: _progress(xs, f"{model} {domain}"))
        for name in engines:
            figures[name][domain] = got[name]
    print(f"[{model}] scored {len(engines)} engines on {len(domains)} held-out domains in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return [{**rows[name], **summary(figures[name])} for name in engines]


def summary(per_domain: dict) -> dict:
    """A row's figures over the held-out domains: each domain's, their mean, and the worst domain's."""
    kld = {d: f["kld_mean"] for d, f in per_domain.items()}
    top1 = {d: f["same_top1"] for d, f in per_domain.items()}
    worst = max(kld, key=kld.get)
    return {"domains": per_domain, "tokens": sum(f["tokens"] for f in per_domain.values()),
            "kld_mean": sum(kld.values()) / len(kld), "kld_worst": kld[worst], "worst_domain": worst,
            "same_top1": sum(top1.values()) / len(top1), "same_top1_worst": min(top1.values())}


def remeasure_speed(model: str, rows: list[dict], args) -> list[dict]:
    """The rows again, each with its decode tok/s measured now (ours rebuilt from the cache, llama.cpp's files)."""
    from transformers import AutoTokenizer

    from pipeline.fidelity import corpus_chunks
    only = args.only.split(",") if args.only else None
    ours = [r for r in rows if r["engine"] == "ours" and r["build"] in BUILDS[model]
            and (not only or any(o in r["build"] for o in only))]
    if not ours:
        return rows
    built = {r["build"]: build(BUILDS[model][r["build"]]) for r in ours}  # every build before any timing
    first = next(iter(built.values()))
    ids = [i for c in corpus_chunks(AutoTokenizer.from_pretrained(first["model_dir"]), args.ctx, 1)
           for i in c][:SPEED_PROMPT]
    files = {} if args.no_llama_cpp else llama_files(first, model)
    jobs = {**{("ours", name): ("ours", m) for name, m in built.items()},
            **{("llama.cpp", r["build"]): ("llama.cpp", files[r["build"]])
               for r in rows if r["engine"] == "llama.cpp" and r["build"] in files}}
    speeds = decode_speeds(jobs, ids, args.threads)
    for r in rows:
        r["decode_tok_s"] = speeds.get((r["engine"], r["build"]), r.get("decode_tok_s"))
    return rows


def decode_speeds(jobs: dict, ids: list[int], threads: int, rounds: int = SPEED_ROUNDS) -> dict:
    """Median decode tok/s of each job ((engine, manifest or GGUF path) by key) after the prompt `ids` (SPEED_NEW
    tokens, greedy, EOS ignored). The runs go in rounds, one run of every job per round, so a slow spell of the
    machine lands on every row alike instead of on the rows measured during it."""
    import statistics

    from compare import run_ours, run_worker
    scenario = {"d400": (ids, SPEED_NEW)}
    runs = {key: [] for key in jobs}
    for _ in range(rounds):
        for key, (engine, what) in jobs.items():
            r = run_ours(what, scenario, threads) if engine == "ours" else run_worker(engine, str(what), scenario,
                                                                                     threads)
            runs[key].append(r["scenarios"]["d400"]["decode_tok_s"])
    return {key: statistics.median(xs) for key, xs in runs.items()}


def plot(results: dict, path: Path) -> None:
    """KLD (log) against file bits/weight, a panel per model: ours as circles, llama.cpp as squares, decode tok/s as
    the colour (grey where not measured)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = [m for m in results if results[m]]
    speeds = [r["decode_tok_s"] for m in models for r in results[m] if r.get("decode_tok_s")]
    norm = matplotlib.colors.Normalize(min(speeds, default=0), max(speeds, default=1))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in results[model]:
            if r["kld_worst"] <= 0 or r["bits_per_weight"] > 20:
                continue  # the float reference, and fp32 builds, off the chart
            color = plt.cm.viridis(norm(r["decode_tok_s"])) if r.get("decode_tok_s") else "lightgrey"
            ax.scatter(r["bits_per_weight"], r["kld_worst"], s=70, color=color, edgecolors="black",
                       marker="o" if r["engine"] == "ours" else "s")
            label = r["build"] if r["engine"] != "ours" else r["build"].split(" (")[0][:28]
            ax.annotate(label, (r["bits_per_weight"], r["kld_worst"]), fontsize=6, xytext=(4, 3),
                        textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("file bits / weight")
        ax.set_ylabel("KLD vs the float model, worst held-out domain")
        ax.set_title(f"{model}: circles ours, squares llama.cpp")
        ax.grid(alpha=0.3)
    if speeds:
        fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap="viridis"), ax=axes[0].tolist(),
                     label="decode tok/s, 2 threads, after 400 tokens")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=130, bbox_inches="tight")
    tmp.replace(path)
    plt.close(fig)


def _progress(chunks, model):
    for i, c in enumerate(chunks):
        print(f"[{model}] chunk {i + 1}/{len(chunks)}", flush=True)
        yield c


def ordered(model: str, rows: list[dict]) -> list[dict]:
    """Our rows in BUILDS order (rows of builds no longer listed after them), then llama.cpp's by bits/weight."""
    names = list(BUILDS.get(model, {}))
    ours = sorted((r for r in rows if r["engine"] == "ours"),
                  key=lambda r: names.index(r["build"]) if r["build"] in names else len(names))
    return ours + sorted((r for r in rows if r["engine"] != "ours"), key=lambda r: r["bits_per_weight"])


def table(model: str, rows: list[dict]) -> str:
    """One row per build: KLD on each held-out domain (the worst in bold), their mean and worst, same top-1."""
    domains = list(rows[0]["domains"]) if rows else []
    head = ("| engine | build | bits/weight | " + " | ".join(f"KLD {d}" for d in domains) +
            " | KLD mean | KLD worst | top-1 mean | top-1 worst | decode tok/s |")
    lines = [f"### {model}", "", head, "|" + "---|" * (len(domains) + 8)]
    for r in rows:
        speed = f"{r['decode_tok_s']:.0f}" if r.get("decode_tok_s") else "-"
        cells = [(f"**{r['domains'][d]['kld_mean']:.4f}**" if d == r["worst_domain"] else
                  f"{r['domains'][d]['kld_mean']:.4f}") for d in domains]
        lines.append(f"| {r['engine']} | {r['build']} | {r['bits_per_weight']:.2f} | " + " | ".join(cells) +
                     f" | {r['kld_mean']:.4f} | {r['kld_worst']:.4f} ({r['worst_domain']}) | "
                     f"{100 * r['same_top1']:.1f} % | {100 * r['same_top1_worst']:.1f} % | {speed} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk; the second half of each is scored")
    ap.add_argument("--chunks", type=int, default=4,
                    help="chunks of each held-out domain (4 x 256 = 1024 scored tokens a domain)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", help="only our builds whose name contains one of these (comma-separated)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--print", action="store_true", help="print the tables of the last results, measure nothing")
    ap.add_argument("--speed", action="store_true", help="measure each row's decode tok/s too")
    ap.add_argument("--speed-only", action="store_true",
                    help="measure the decode tok/s of the last results' rows again, scoring nothing (a build whose "
                         "entry no longer matches the code is rebuilt first)")
    ap.add_argument("--plot", action="store_true", help="draw the frontier (outputs/bench/fidelity.png)")
    ap.add_argument("--plot-only", action="store_true", help="draw the frontier of the last results, measure nothing")
    ap.add_argument("--docs", action="store_true", help="also write the picture to docs/img/frontier.png")
    args = ap.parse_args()
    out = ROOT / "outputs" / "bench" / "fidelity.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    results = {m: [r for r in rows if "domains" in r] for m, rows in results.items()}  # the one-corpus rows: gone
    if args.speed_only:
        for model in args.models.split(","):
            results[model] = remeasure_speed(model, results.get(model, []), args)
            out.write_text(json.dumps(results, indent=2))
            print(table(model, ordered(model, results[model])) + "\n", flush=True)
        if args.plot:
            draw(results, args.docs)
        return
    if args.print or args.plot_only:
        for model in args.models.split(","):
            print(table(model, ordered(model, results.get(model, []))) + "\n")
        if args.plot_only:
            draw(results, args.docs)
        return
    for model in args.models.split(","):
        rows = {(r["engine"], r["build"]): r for r in results.get(model, [])}  # rows not measured now stay
        rows.update({(r["engine"], r["build"]): r for r in measure(model, args)})
        results[model] = list(rows.values())
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print(table(model, ordered(model, results[model])), flush=True)
    if args.plot:
        draw(results, args.docs)
    print(f"\nwrote {out}")


def draw(results: dict, docs: bool) -> None:
    for path in [ROOT / "outputs" / "bench" / "fidelity.png"] + ([ROOT / "docs" / "img" / "frontier.png"] if docs else []):
        plot(results, path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
