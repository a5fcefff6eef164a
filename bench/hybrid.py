"""A recurrent hybrid's decode speed against depth, and its prefill speed against the chunk, through our C++ runner, in
one invocation with alternating runs (a benchmark, not a test).

    python bench/hybrid.py                              # both tables, 2 threads, 3 rounds
    python bench/hybrid.py --tables depth --threads 1,2 --rounds 5
    python bench/hybrid.py --no-dense                   # without the attention-only model beside it
    python bench/hybrid.py --kv-dtypes fp32             # K/V stored in fp32 only (default: fp32 and bf16)

The hybrid is recipes/scale_qwen35_08b.yaml: Qwen3.5-0.8B's geometry with random weights (18 Gated DeltaNet layers, 6
full-attention layers, 0.54 B parameters), 8da4w, off-graph cache, XNNPACK, context 4096, prefill chunk 128. Beside
it (--dense, on by default) the same dims as an attention-only Qwen3 (24 full-attention layers of 8 query heads of
256, 2 KV heads): the models whose decode slows with depth, for the ratio the hybrid is held to.

- depth: 64 tokens decoded after a prompt of d tokens, d = 16, 512, 2048 and the deepest the program allows
  (context - 65), per K/V storage dtype (--kv-storage-dtype; the state is fp32 whatever it is); each deep row as a
  share of d16, and the milliseconds a token costs over d16. A recurrent layer reads and writes a fixed state per
  token whatever d; only the attention layers' K/V reads grow, so the hybrid's extra milliseconds are the dense
  model's times its share of attention layers (6 of 24).
- prefill: a 512-token prompt at prefill chunks 1, 32, 128, 512 (one build each: the chunk is exported), tok/s.
Prints Markdown tables; writes outputs/bench/hybrid.json.
"""
from __future__ import annotations

import argparse
import statistics

from common import build, write_results  # noqa: E402  (bench/ is the script's folder)

HYBRID = ["recipe=scale_qwen35_08b"]
DENSE = HYBRID + ["model.random.arch=qwen3", "model.name=random-qwen3-dense-08b"]
DECODE = 64
CHUNKS = (1, 32, 128, 512)
PREFILL = 512


def runner(m: dict, ids: list[int], new: int, threads: int, kv_dtype: str = "fp32") -> dict:
    from pipeline import native
    return native.run(m["pte"], m["tokenizer"], prompt_ids=ids, max_new_tokens=new,
                      extra_args=[*native.cache_args(m), "--kv-storage-dtype", kv_dtype, "--ignore-eos", "--warmup",
                                  "--threads", str(threads)])


def prompt(n: int) -> list[int]:
    return [(i * 7919) % 30000 + 3 for i in range(n)]  # varied ids inside the 32k vocabulary


def depths(context: int) -> list[int]:
    return [16, 512, 2048, context - DECODE - 1]


def depth_table(builds: dict[str, dict], threads: int, rounds: int, kv_dtype: str) -> dict:
    context = builds["hybrid"]["config"]["export"]["max_context_len"]
    runs = {(name, d): [] for name in builds for d in depths(context)}
    for _ in range(rounds):  # alternating, so drift hits every row alike
        for d in depths(context):
            for name, m in builds.items():
                runs[name, d].append(runner(m, prompt(d), DECODE, threads, kv_dtype)["decode_tok_s"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    names = list(builds)
    print(f"\n{threads} thread(s), K/V {kv_dtype}: decode tok/s (median of {rounds}), {DECODE} tokens after a prompt "
          f"of d tokens\n")
    print("| depth | " + " | ".join(f"{n} tok/s | {n} / d16 | {n} ms/token over d16" for n in names) + " |")
    print("|---|" + "---|---|---|" * len(names))
    for d in depths(context):
        cells = [f"{med[n, d]:.1f} | {med[n, d] / med[n, 16]:.0%} | {1e3 / med[n, d] - 1e3 / med[n, 16]:.1f}"
                 for n in names]
        print(f"| {d} | " + " | ".join(cells) + " |")
    return {f"{n} d{d}": {"median": med[n, d], "runs": runs[n, d], "share_of_d16": med[n, d] / med[n, 16]}
            for n in names for d in depths(context)}


def prefill_table(threads: int, rounds: int) -> dict:
    builds = {c: build(HYBRID + [f"export.prefill_chunk={c}"]) for c in CHUNKS}
    runs = {c: [] for c in CHUNKS}
    for _ in range(rounds):
        for c, m in builds.items():
            runs[c].append(runner(m, prompt(PREFILL), 1, threads)["prefill_tok_s"])
    med = {c: statistics.median(v) for c, v in runs.items()}
    print(f"\n{threads} thread(s), prefill of {PREFILL} tokens, tok/s (median of {rounds})\n")
    print("| chunk | prefill tok/s | vs chunk 1 |\n|---|---|---|")
    for c in CHUNKS:
        print(f"| {c} | {med[c]:.1f} | x{med[c] / med[1]:.1f} |")
    return {f"chunk {c}": {"median": med[c], "runs": runs[c]} for c in CHUNKS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", default="depth,prefill")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-dense", action="store_true", help="the hybrid alone in the depth table")
    ap.add_argument("--kv-dtypes", default="fp32,bf16", help="K/V storage dtypes of the depth table")
    a = ap.parse_args()
    tables = a.tables.split(",")
    results = {}
    builds = {"hybrid": build(HYBRID)}
    if not a.no_dense:
        builds["dense"] = build(DENSE)
    for t in map(int, a.threads.split(",")):
        if "depth" in tables:
            for kv in a.kv_dtypes.split(","):
                results[f"depth t{t} kv {kv}"] = depth_table(builds, t, a.rounds, kv)
        if "prefill" in tables:
            results[f"prefill t{t}"] = prefill_table(t, a.rounds)
    write_results("hybrid", results)


if __name__ == "__main__":
    main()
