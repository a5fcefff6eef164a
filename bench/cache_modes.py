"""Prefill and decode speed of the KV-cache modes (static, custom, offgraph, stock) for both real models,
through our C++ runner, in one invocation with alternating runs (a benchmark, not a test). `stock` runs ExecuTorch's
own llama:: ops, on native/'s twins of them in the C++ runner.

    python bench/cache_modes.py                      # both models, 3 rounds
    python bench/cache_modes.py --models smollm2 --rounds 5 --prompt-tokens 400 --new-tokens 128

Each mode is a pipeline build (the stage cache makes repeat runs cheap; verify is skipped here, the
recipes verify themselves). For SmolLM2 the yardstick the issue names is added: the same 8da4w model
exported with ExecuTorch's own llama::update_cache / llama::custom_sdpa (bench/et_ops.py) and run through
the ExecuTorch Python runtime; our custom program runs through the same Python harness for the ratio.
Prints medians and ratios against `static`; writes outputs/bench/cache_modes.json.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, build, write_results  # noqa: E402  (bench/ is the script's folder)

# per model: mode -> pipeline overrides (same weights and quantization within a model)
MODES = {
    "smollm2": {
        "static": ["recipe=smollm2_xnnpack_8da4w"],
        "custom": ["recipe=smollm2_custom"],
        "offgraph": ["recipe=smollm2_offgraph", "quantize=8da4w"],
        "stock": ["recipe=smollm2_custom", "cache=stock"],
    },
    "gemma3": {
        "static": ["recipe=gemma3_xnnpack"],
        "custom": ["recipe=gemma3_custom"],
        "offgraph": ["recipe=gemma3_offgraph"],
        "stock": ["recipe=gemma3_custom", "cache=stock"],
    },
}
TEXT = ("The history of the printing press begins in the fifteenth century, when movable type made books "
        "cheaper to produce and easier to share. Within a few decades, printers across Europe were "
        "publishing bibles, grammars, calendars and pamphlets, and the number of readers grew with them. ")


def prompt_ids(tokenizer: str, pte: str, n: int) -> list[int]:
    from pipeline import native
    ids: list[int] = []
    text = TEXT
    while len(ids) < n:
        ids = native.encode(tokenizer, text, "0", pte=pte)
        text += TEXT
    return ids[:n]


def runner_once(m: dict, ids: list[int], new: int, threads: int) -> dict:
    from pipeline import native
    extra = ["--ignore-eos", "--warmup", "--threads", str(threads), *native.cache_args(m)]
    return native.run(m["pte"], m["tokenizer"], prompt_ids=ids, max_new_tokens=new, extra_args=extra)


def python_runtime_once(pte: Path, ids: list[int], new: int, chunk: int) -> dict:
    """Prefill in chunks then greedy decode through the ExecuTorch Python runtime (kernels loaded)."""
    import torch

    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (the yardstick's llama:: ops)

    from pipeline.runtimes import executorch
    from pipeline.runtimes.base import RunnerProgram
    module = RunnerProgram(executorch, pte, kernels=("llmpipe",))
    t0 = time.perf_counter()
    for s in range(0, len(ids), chunk):
        piece = ids[s:s + chunk]
        logits = module(torch.tensor([piece]), torch.arange(s, s + len(piece)))
    t1 = time.perf_counter()
    out = []
    for i in range(new):
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        logits = module(torch.tensor([[tok]]), torch.tensor([len(ids) + i]))
    t2 = time.perf_counter()
    return {"prefill_tok_s": len(ids) / (t1 - t0), "decode_tok_s": new / (t2 - t1), "generated_ids": out}


def et_ops_program(model_dir: str, context: int, chunk: int) -> Path:
    out = ROOT / "outputs" / "bench" / f"et_ops_smollm2_8da4w_{context}_{chunk}.pte"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"exporting the ExecuTorch-ops yardstick to {out} (several minutes) ...", flush=True)
        subprocess.run([sys.executable, str(ROOT / "bench" / "et_ops.py"), "--model-dir", model_dir,
                        "--out", str(out), "--quantize", "8da4w", "--context", str(context), "--chunk", str(chunk)],
                       check=True)
    return out


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-et-ops", action="store_true", help="skip the ExecuTorch-ops yardstick")
    a = ap.parse_args()
    results = {"threads": a.threads, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
               "rounds": a.rounds, "models": {}}
    for model in a.models.split(","):
        builds = {mode: build(ov) for mode, ov in MODES[model].items()}
        any_m = next(iter(builds.values()))
        ids = prompt_ids(any_m["tokenizer"], any_m["pte"], a.prompt_tokens)
        runs: dict[str, list[dict]] = {mode: [] for mode in builds}
        py_runs: dict[str, list[dict]] = {}
        et = None
        if model == "smollm2" and not a.no_et_ops:
            cfg = builds["custom"]["config"]["export"]
            et = et_ops_program(any_m["model_dir"], cfg["max_context_len"], cfg["prefill_chunk"])
            py_runs = {"custom (python runtime)": [], "executorch llama ops (python runtime)": []}
        for r in range(a.rounds):  # alternate modes within each round
            for mode, m in builds.items():
                runs[mode].append(runner_once(m, ids, a.new_tokens, a.threads))
            if et is not None:
                chunk = builds["custom"]["config"]["export"]["prefill_chunk"]
                py_runs["custom (python runtime)"].append(
                    python_runtime_once(Path(builds["custom"]["pte"]), ids, a.new_tokens, chunk))
                py_runs["executorch llama ops (python runtime)"].append(python_runtime_once(et, ids, a.new_tokens, chunk))
            print(f"[{model}] round {r + 1}/{a.rounds} done", flush=True)
        rows = {}
        for mode, rs in runs.items():
            m = builds[mode]
            rows[mode] = {"engine": "llm_runner", "chunk": m["config"]["export"]["prefill_chunk"],
                          "pte_mib": Path(m["pte"]).stat().st_size / 2**20,
                          "prefill_tok_s": med([x["prefill_tok_s"] for x in rs]),
                          "decode_tok_s": med([x["decode_tok_s"] for x in rs]),
                          "ttft_ms": med([x["ttft_ms"] for x in rs]),
                          "peak_rss_mib": max(x["peak_rss_mib"] for x in rs)}
        for label, rs in py_runs.items():
            rows[label] = {"engine": "python runtime", "chunk": builds["custom"]["config"]["export"]["prefill_chunk"],
                           "prefill_tok_s": med([x["prefill_tok_s"] for x in rs]),
                           "decode_tok_s": med([x["decode_tok_s"] for x in rs])}
        if py_runs:
            a_ids, b_ids = (py_runs[k][0]["generated_ids"] for k in py_runs)
            rows["executorch llama ops (python runtime)"]["greedy_tokens_equal_custom"] = \
                sum(x == y for x, y in zip(a_ids, b_ids))
        base = rows["static"]
        for row in rows.values():
            row["prefill_vs_static"] = row["prefill_tok_s"] / base["prefill_tok_s"]
            row["decode_vs_static"] = row["decode_tok_s"] / base["decode_tok_s"]
        results["models"][model] = rows
        print(f"\n{model}: prompt {len(ids)} tokens, {a.new_tokens} new, {a.threads} threads, "
              f"medians of {a.rounds} alternating rounds")
        print(f"  {'mode':<40} {'chunk':>5} {'prefill tok/s':>13} {'decode tok/s':>12} {'x static':>17} "
              f"{'peak RSS MiB':>12}")
        for name, row in rows.items():
            rss = f"{row['peak_rss_mib']:.0f}" if "peak_rss_mib" in row else "-"
            print(f"  {name:<40} {row['chunk']:>5} {row['prefill_tok_s']:>13.1f} {row['decode_tok_s']:>12.1f} "
                  f"{row['prefill_vs_static']:>7.2f}p {row['decode_vs_static']:>7.2f}d {rss:>12}")
        if py_runs:
            ours = rows["custom (python runtime)"]
            theirs = rows["executorch llama ops (python runtime)"]
            print(f"  custom vs ExecuTorch's llama ops, both in the Python runtime: prefill "
                  f"x{ours['prefill_tok_s'] / theirs['prefill_tok_s']:.2f}, decode "
                  f"x{ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}; our C++ runner's custom decode vs "
                  f"their Python-runtime decode x{rows['custom']['decode_tok_s'] / theirs['decode_tok_s']:.2f} "
                  f"(greedy tokens equal: {theirs['greedy_tokens_equal_custom']}/{a.new_tokens})")
    write_results("cache_modes", results)


if __name__ == "__main__":
    main()
