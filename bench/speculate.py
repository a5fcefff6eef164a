"""Decode tok/s of llm_runner with and without prompt-lookup speculation (--speculate ngram), on the real models.

    python bench/speculate.py                          # SmolLM2 (the default build) and Gemma 3 (gemma3_offgraph)
    python bench/speculate.py --models smollm2 --rounds 3
    python bench/speculate.py --pte P --tokenizer T    # any program built with logits selected or full

Three kinds of prompt, written for this benchmark (PROMPTS below), three prompts each:
- rewrite: a paragraph to copy with a few small edits (the output quotes the prompt almost whole);
- summary: a text to summarize, quoting sentences of it;
- free: open generation (little to copy: speculation must cost next to nothing).
Each prompt runs greedy, as a chat turn, up to --new-tokens tokens (stopping at the model's end of turn), at
2 threads, in a process of its own: plain and speculative runs alternate for --rounds rounds and the median decode
tok/s of each is kept. The speculative run's tokens must equal the plain run's (greedy): the table says so.
Prints one Markdown table per model (per kind: plain and speculative tok/s, speedup, tokens drafted and accepted)
and writes outputs/bench/speculate.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from common import ROOT, build, write_results

from pipeline import native

PARAGRAPH = (
    "The old lighthouse on the northern cliff was built in 1874 by a team of twelve masons from the village. "
    "For almost a century its lamp turned every night, and sailors said that its beam could be seen from forty "
    "miles away on a clear evening. In 1969 the light was replaced by an automatic beacon on a steel mast, and the "
    "keepers moved to the town below. Today the tower is a small museum, open from April to October, where "
    "visitors can climb the one hundred and nine steps to the gallery and look out over the bay.")
ARTICLE = (
    "Researchers at the coastal station counted the seabirds nesting on the island every spring for twenty years. "
    "They found that the number of puffins fell by almost half between 2004 and 2014, while the number of gulls "
    "stayed nearly the same. \"The puffins depend on small fish that live near the surface, and those fish moved "
    "further north as the water warmed,\" said the lead author of the study. The team also noticed that the birds "
    "that did nest raised fewer chicks in warm years. Since 2015 the count has risen slightly, which the authors "
    "link to a series of cooler summers. \"One good decade will not undo the decline,\" she added, \"but it shows "
    "how quickly the colony responds when food is plentiful.\"")
RECIPE = (
    "To make the bread, mix five hundred grams of flour with ten grams of salt and seven grams of dried yeast. Add "
    "three hundred and fifty millilitres of warm water and knead the dough for ten minutes, until it is smooth. "
    "Leave it in a covered bowl for one hour, then shape it into a loaf and let it rise for another forty minutes. "
    "Bake it at two hundred and twenty degrees for thirty minutes, until the crust is golden and the loaf sounds "
    "hollow when tapped.")
PROMPTS = {
    "rewrite": [
        f"Rewrite this paragraph exactly, word for word, but change 1874 to 1881 and twelve to fifteen:\n\n{PARAGRAPH}",
        f"Copy the following recipe, changing only the salt to eight grams and the oven to two hundred degrees:\n\n"
        f"{RECIPE}",
        f"Repeat this text with one change: write 'puffins' as 'Atlantic puffins' everywhere.\n\n{ARTICLE}",
    ],
    "summary": [
        f"Summarize this article in three sentences, quoting the lead author's words exactly.\n\n{ARTICLE}",
        f"Summarize the history of the lighthouse below, quoting the sentence about the museum word for word."
        f"\n\n{PARAGRAPH}",
        f"Give a short summary of this recipe, then quote its baking instruction exactly.\n\n{RECIPE}",
    ],
    "free": [
        "Write a short story about a fox who learns to swim.",
        "Explain in a few paragraphs why the sky is blue.",
        "Give me five ideas for a rainy afternoon with children, with a sentence on each.",
    ],
}
MODELS = {"smollm2": [], "gemma3": ["recipe=gemma3_offgraph"]}
SPEC_FLAGS: list[str] = []  # --draft-max / --ngram-min / --ngram-max given to the speculative runs


def run(pte: str, tokenizer: str, prompt: str, new_tokens: int, spec: bool, extra: list[str]) -> dict:
    args = [str(native.runner_path()), "--pte", pte, "--tokenizer", tokenizer, "--prompt", prompt, "--max-new-tokens",
            str(new_tokens), "--threads", "2", "--quiet", *extra] + (["--speculate", "ngram", *SPEC_FLAGS] if spec else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(f"llm_runner failed:\n{r.stderr[-3000:]}")
    return json.loads(next(ln.split(": ", 1)[1] for ln in r.stderr.splitlines() if ln.startswith("STATS_JSON: ")))


def measure(pte: str, tokenizer: str, extra: list[str], rounds: int, new_tokens: int, kinds: list[str]) -> dict:
    out = {}
    for kind in kinds:
        prompts = PROMPTS[kind]
        rows = []
        for prompt in prompts:
            plain, spec = [], []
            for _ in range(rounds):
                plain.append(run(pte, tokenizer, prompt, new_tokens, False, extra))
                spec.append(run(pte, tokenizer, prompt, new_tokens, True, extra))
            s = spec[-1]["speculation"]
            rows.append({
                "prompt": prompt[:60], "tokens": len(plain[-1]["generated_ids"]),
                "plain_tok_s": statistics.median(p["decode_tok_s"] for p in plain),
                "spec_tok_s": statistics.median(p["decode_tok_s"] for p in spec),
                "drafted": s["drafted"], "accepted": s["accepted"], "verify_steps": s["verify_steps"],
                "identical": all(x["generated_ids"] == plain[0]["generated_ids"] for x in plain + spec)})
            print(f"  {kind:8s} {rows[-1]}", flush=True)
        plain_total = sum(r["tokens"] / r["plain_tok_s"] for r in rows)  # seconds of decode, the kind's prompts
        spec_total = sum(r["tokens"] / r["spec_tok_s"] for r in rows)
        drafted = sum(r["drafted"] for r in rows)
        out[kind] = {"rows": rows, "plain_tok_s": round(sum(r["tokens"] for r in rows) / plain_total, 1),
                     "spec_tok_s": round(sum(r["tokens"] for r in rows) / spec_total, 1),
                     "speedup": round(plain_total / spec_total, 2), "drafted": drafted,
                     "accepted": sum(r["accepted"] for r in rows),
                     "acceptance": round(sum(r["accepted"] for r in rows) / drafted, 3) if drafted else None,
                     "identical": all(r["identical"] for r in rows)}
    return out


def table(name: str, res: dict) -> str:
    lines = [f"\n### {name}\n", "| prompts | plain tok/s | --speculate ngram tok/s | speedup | drafted | accepted "
             "(rate) | greedy tokens identical |", "|---|---|---|---|---|---|---|"]
    for kind, r in res.items():
        lines.append(f"| {kind} ({len(r['rows'])}) | {r['plain_tok_s']} | {r['spec_tok_s']} | {r['speedup']}x | "
                     f"{r['drafted']} | {r['accepted']} ({r['acceptance']}) | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3", help=f"comma list of {sorted(MODELS)}")
    ap.add_argument("--pte", help="a program of your own (with --tokenizer)")
    ap.add_argument("--tokenizer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--kinds", default=",".join(PROMPTS), help="comma list of the prompt kinds to run")
    ap.add_argument("--draft-max", type=int, help="llm_runner's default unless given")
    ap.add_argument("--ngram-min", type=int)
    ap.add_argument("--ngram-max", type=int)
    args = ap.parse_args()
    for flag in ("draft_max", "ngram_min", "ngram_max"):
        if getattr(args, flag) is not None:
            SPEC_FLAGS.extend([f"--{flag.replace('_', '-')}", str(getattr(args, flag))])
    results = {}
    targets = [("pte", args.pte, args.tokenizer, [])] if args.pte else []
    for name in ([] if args.pte else args.models.split(",")):
        m = build(MODELS[name])
        extra = ["--kv-max-capacity", str(m["config"]["export"]["max_context_len"])] \
            if m["config"]["cache"]["mode"] == "offgraph" else []
        targets.append((name, m["pte"], m["tokenizer"], extra))
    for name, pte, tokenizer, extra in targets:
        print(f"{name}: {pte}", flush=True)
        results[name] = measure(pte, tokenizer, extra, args.rounds, args.new_tokens, args.kinds.split(","))
    for name, res in results.items():
        print(table(name, res))
    write_results("speculate", results)


if __name__ == "__main__":
    main()
