"""Aggregate decode tok/s of llm_batched_runner with 4 sessions against 4 sequential llm_runner runs.

    python bench/batched.py                                   # the tiny Gemma 3 with logits 'full'
    python bench/batched.py --tiny og_llama_selected          # another tiny program (offgraph_tiny_export.py)
    python bench/batched.py --pte outputs/.../program.pte --rounds 5 --prompt-tokens 64 --new-tokens 64

The same 4 prompts (distinct token ids, no tokenizer needed) go once through one batched run (4 sessions
at once, decode-first scheduler) and once through 4 single-session llm_runner runs, alternating, for
--rounds rounds. Batched decode tok/s is the engine's (decode tokens over the forward time spent on
decode rows); sequential is the 4 runs' decode tokens over their decode time. The ratio is the point:
with logits 'full' or 'selected' the decode rows of the 4 sessions share one forward ('selected' computes
the logits of those rows only); a 'last' program has one logits row per forward, so its decode cannot be
shared and the ratio stays near 1.
Without --pte the tiny off-graph programs are exported once (tests/native/offgraph_tiny_export.py) into
outputs/bench/batched_programs/. Prints medians and writes outputs/bench/batched.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TINY_DIR = ROOT / "outputs" / "bench" / "batched_programs"


def tiny_program(name: str) -> Path:
    if not (TINY_DIR / f"{name}.pte").exists():
        print(f"exporting the tiny off-graph programs to {TINY_DIR} ...", flush=True)
        subprocess.run([sys.executable, str(ROOT / "tests" / "native" / "offgraph_tiny_export.py"), str(TINY_DIR)],
                       check=True)
    return TINY_DIR / f"{name}.pte"


def prompts(n_sessions: int, n_tokens: int) -> list[list[int]]:
    # distinct small ids (valid in any vocabulary >= 128); different from the first token on
    return [[3 + (17 * s + 7 * j + s * j) % 117 for j in range(n_tokens)] for s in range(n_sessions)]


def stats_line(stderr: str, tag: str) -> list[dict]:
    return [json.loads(ln.split(f"{tag}: ", 1)[1]) for ln in stderr.splitlines() if ln.startswith(f"{tag}: ")]


def run(args: list[str]) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args[:3])} ... failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stderr


def batched_once(bin_: Path, pte: Path, ps: list[list[int]], new: int, capacity: int, threads: int,
                 max_sessions: int) -> dict:
    err = run([str(bin_), "--pte", str(pte), "--ids", "--quiet", "--ignore-eos", "--max-new-tokens", str(new),
               "--max-session-tokens", str(capacity), "--max-decode-sequences", str(max_sessions),
               "--threads", str(threads), *(",".join(map(str, p)) for p in ps)])
    (engine,) = stats_line(err, "ENGINE_JSON")
    gens = stats_line(err, "GEN_JSON")
    return {"decode_tok_s": engine["decode_tok_s"], "wall_ms": engine["wall_ms"], "forwards": engine["forwards"],
            "logits_mode": engine["logits_mode"], "shared": engine["shared_decode_forwards"],
            "tokens": [g["generated_ids"] for g in gens]}


def sequential_once(bin_: Path, pte: Path, ps: list[list[int]], new: int, capacity: int, threads: int) -> dict:
    steps = decode_ms = wall_ms = 0.0
    tokens = []
    for p in ps:
        err = run([str(bin_), "--pte", str(pte), "--prompt-ids", ",".join(map(str, p)), "--quiet", "--ignore-eos",
                   "--max-new-tokens", str(new), "--kv-max-capacity", str(capacity), "--threads", str(threads)])
        (s,) = stats_line(err, "STATS_JSON")
        steps += s["decode_steps"]
        decode_ms += s["decode_ms"]
        wall_ms += s["prefill_ms"] + s["decode_ms"]
        tokens.append(s["generated_ids"])
    return {"decode_tok_s": steps * 1000.0 / decode_ms, "wall_ms": wall_ms, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pte", type=Path, help="an off-graph program (default: the tiny Gemma 3, logits 'full')")
    ap.add_argument("--tiny", default="og_gemma3_full", help="without --pte: which tiny off-graph program "
                    "(og_gemma3, og_gemma3_full, og_gemma3_selected, og_llama, og_llama_full, og_llama_selected)")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from pipeline import native
    runner = native.runner_path(build=True)
    batched_bin = native.BUILD_DIR / "llm_batched_runner"
    if not batched_bin.exists():
        native.build_native(force=True)
    pte = a.pte or tiny_program(a.tiny)
    ps = prompts(a.sessions, a.prompt_tokens)
    capacity = a.prompt_tokens + a.new_tokens + 1
    runs = {"batched": [], "batched, one session at a time": [], "sequential llm_runner": []}
    for r in range(a.rounds):  # alternate within each round
        runs["batched"].append(batched_once(batched_bin, pte, ps, a.new_tokens, capacity, a.threads, a.sessions))
        runs["batched, one session at a time"].append(
            batched_once(batched_bin, pte, ps, a.new_tokens, capacity, a.threads, 1))
        runs["sequential llm_runner"].append(sequential_once(runner, pte, ps, a.new_tokens, capacity, a.threads))
        print(f"round {r + 1}/{a.rounds} done", flush=True)
    rows = {k: {"decode_tok_s": statistics.median(x["decode_tok_s"] for x in v),
                "wall_ms": statistics.median(x["wall_ms"] for x in v)} for k, v in runs.items()}
    seq = rows["sequential llm_runner"]
    for row in rows.values():
        row["decode_ratio"] = row["decode_tok_s"] / seq["decode_tok_s"]
        row["wall_ratio"] = seq["wall_ms"] / row["wall_ms"]
    first = runs["batched"][0]
    same = first["tokens"] == runs["sequential llm_runner"][0]["tokens"]
    print(f"\n{pte}: logits '{first['logits_mode']}' (decode rows share forwards: {first['shared']}), "
          f"{a.sessions} sessions x ({a.prompt_tokens} prompt + {a.new_tokens} new tokens), {a.threads} threads, "
          f"medians of {a.rounds} alternating rounds; greedy tokens equal: {same}")
    print(f"  {'engine':<34} {'decode tok/s':>12} {'x sequential':>12} {'wall ms':>9} {'x sequential':>12}")
    for name, row in rows.items():
        print(f"  {name:<34} {row['decode_tok_s']:>12.1f} {row['decode_ratio']:>12.2f} {row['wall_ms']:>9.1f} "
              f"{row['wall_ratio']:>12.2f}")
    results = {"pte": str(pte), "logits_mode": first["logits_mode"], "shared_decode_forwards": first["shared"],
               "sessions": a.sessions, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
               "threads": a.threads, "rounds": a.rounds, "greedy_tokens_equal": same, "engines": rows,
               "decode_ratio": rows["batched"]["decode_ratio"]}
    out = ROOT / "outputs" / "bench" / "batched.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\naggregate decode tok/s, {a.sessions} sessions vs {a.sessions} sequential runs: "
          f"x{results['decode_ratio']:.2f}\nwrote {out}")


if __name__ == "__main__":
    main()
