"""llm_runner's decode and prefill speed on each ISA path of our kernels (LLMPIPE_ISA), at a depth of --depth tokens.

    python bench/isa_paths.py                               # the default build, every path this CPU has
    python bench/isa_paths.py --pte P --tokenizer T --rounds 5
    # on an ARM64 device, with native/build-aarch64/ copied beside it (docs/benchmarks.md):
    python3 isa_paths.py --runner ./llm_runner --pte model.pte --tokenizer tokenizer.json --paths scalar,neon,dotprod

A prompt of --depth tokens (a text of this file, repeated as needed), then --new tokens greedy with EOS ignored, at
--threads threads, each path in a process of its own; the paths alternate for --rounds rounds and the median of each
is kept. Prints a Markdown table (tok/s and the ratio to the scalar path) and, from a checkout, writes
outputs/bench/isa_paths.json. Under QEMU (--target aarch64) the numbers measure the emulator, not a CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TEXT = (__doc__ or "") + Path(__file__).read_text()  # any text: the speed does not depend on it


def prompt_ids(tokenizer: str, n: int) -> list[int]:
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(tokenizer).encode(TEXT, add_special_tokens=False).ids
    while len(ids) < n:
        ids += ids
    return ids[:n]


def run(command: list[str], path: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "stats.json"
        r = subprocess.run([*command, "--stats-json", str(stats)], capture_output=True, text=True,
                           env={**os.environ, "LLMPIPE_ISA": path}, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            sys.exit(f"LLMPIPE_ISA={path}: {r.stderr[-2000:]}")
        return json.loads(stats.read_text().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pte"), ap.add_argument("--tokenizer")
    ap.add_argument("--runner", help="an llm_runner binary (default: this checkout's native/build/llm_runner)")
    ap.add_argument("--target", choices=("aarch64",), help="this checkout's aarch64 build, under QEMU")
    ap.add_argument("--paths", help="comma-separated LLMPIPE_ISA values (default: every path this CPU has)")
    ap.add_argument("--depth", type=int, default=400, help="prompt tokens before decoding")
    ap.add_argument("--new", type=int, default=100, help="tokens decoded")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    checkout = Path(__file__).resolve().parent.parent
    if args.runner is None or args.pte is None or args.paths is None:
        sys.path.insert(0, str(checkout))
    if args.pte is None:  # the newest default build of this checkout
        runs = sorted((checkout / "outputs" / "runs").glob("*/manifest.json"))
        default = [m for m in map(lambda p: json.loads(p.read_text()), runs)
                   if m.get("status") == "ok" and m.get("recipe") == "default" and m.get("pte")]
        if not default:
            sys.exit("no default build here: run `python -m pipeline` first, or give --pte and --tokenizer")
        args.pte, args.tokenizer = default[-1]["pte"], default[-1]["tokenizer"]
    if args.runner:
        command = [args.runner]
    else:
        from pipeline import native
        command = native.qemu_command("llm_runner", ()) if args.target else [str(native.runner_path())]
    if args.paths:
        paths = args.paths.split(",")
    elif args.target:
        paths = ["scalar", "neon", "dotprod"]
    else:
        from pipeline import ops
        paths = ops.isa_paths()
    ids = prompt_ids(args.tokenizer, args.depth)
    command += ["--pte", args.pte, "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(args.new),
                "--ignore-eos", "--temperature", "0", "--threads", str(args.threads), "--quiet"]
    runs: dict[str, list[dict]] = {p: [] for p in paths}
    for r in range(args.rounds):
        for p in paths:
            runs[p].append(run(command, p))
            print(f"round {r + 1}/{args.rounds} {p}: decode {runs[p][-1]['decode_tok_s']:.1f} tok/s", file=sys.stderr)
    median = {p: {k: statistics.median(x[k] for x in runs[p]) for k in ("decode_tok_s", "prefill_tok_s")}
              for p in paths}
    base = median.get("scalar")
    print(f"\n{Path(args.pte).name}: {args.depth}-token prompt, {args.new} tokens, {args.threads} threads, median of "
          f"{args.rounds}\n\n| path | decode tok/s | vs scalar | prefill tok/s | vs scalar |\n|---|---|---|---|---|")
    for p in paths:
        m = median[p]
        ratio = (lambda k: f"{m[k] / base[k]:.2f}x" if base else "-")
        print(f"| {p} | {m['decode_tok_s']:.1f} | {ratio('decode_tok_s')} | {m['prefill_tok_s']:.0f} | "
              f"{ratio('prefill_tok_s')} |")
    if (checkout / "pipeline").is_dir():
        out = checkout / "outputs" / "bench" / "isa_paths.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"pte": args.pte, "depth": args.depth, "new": args.new, "runs": runs,
                                   "median": median}, indent=2))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
