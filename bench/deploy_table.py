"""For each recipe: the operators its program needs beyond ExecuTorch's stock libraries, whether ExecuTorch's
TextLLMRunner runs it (and gives llm_runner's tokens), and whether it runs on ARM64 (under QEMU, against x86's tokens).

    python bench/deploy_table.py                       # every user recipe that builds here (no hub, no MLX runtime)
    python bench/deploy_table.py --recipes smollm2_gptq gemma3_custom --new 8

Builds through the stage cache up to lower (verify off: the recipe's own build verifies it). Each check runs greedy on
a raw prompt: TextLLMRunner in a process of its own (tests/deploy/text_llm_runner_ids.py) against llm_runner on the
same ids; the aarch64 llm_runner (native/build.sh --target aarch64) under qemu-aarch64 against the x86 runner. Prints
a Markdown table and writes outputs/bench/deploy_table.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, build, write_results

from pipeline import native

PROMPT = "The capital of France is"
DEFAULT = "(default)"  # `python -m pipeline` with no recipe
# recipes that need what this machine has not: the hub (gemma4), the MLX runtime to run them (built and checked by
# our interpreter, not a runtime ExecuTorch's runner or llm_runner can load), the transformers route's two programs
SKIP = {"gemma4_mlx_4w": "hub model", "gemma4_offgraph_4w": "hub model"}


def user_recipes() -> list[str]:
    """The default build (no recipe) first, then every recipe a user picks (not the tests' tiny ones)."""
    return [DEFAULT] + sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")
                              if not p.stem.startswith(("tiny_", "scale_")))


def text_llm_runner(m: dict, new: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        r = subprocess.run([sys.executable, str(ROOT / "tests" / "deploy" / "text_llm_runner_ids.py"), m["pte"],
                            m["tokenizer"], PROMPT, str(new), str(out)], capture_output=True, text=True, timeout=1800)
        return json.loads(out.read_text()) if r.returncode == 0 else {"error": r.stderr[-500:]}


def x86(m: dict, ids: list[int], new: int) -> list[int]:
    return native.run(m["pte"], None, prompt_ids=ids, max_new_tokens=new, extra_args=native.cache_args(m))[
        "generated_ids"]


def aarch64(m: dict, ids: list[int], new: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        stats = Path(tmp) / "s.json"
        cmd = native.qemu_command("llm_runner", ["--pte", m["pte"], "--prompt-ids", ",".join(map(str, ids)),
                                                 "--max-new-tokens", str(new), "--chat", "0", "--quiet",
                                                 "--stats-json", str(stats), *native.cache_args(m)])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
        return json.loads(stats.read_text().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="*", help="default: every user recipe that builds here")
    ap.add_argument("--new", type=int, default=8, help="greedy tokens each check compares")
    args = ap.parse_args()
    native.aarch64_build()
    rows = []
    for recipe in args.recipes or user_recipes():
        if recipe in SKIP:
            rows.append({"recipe": recipe, "skipped": SKIP[recipe]})
            continue
        print(f"== {recipe}", file=sys.stderr)
        m = build([] if recipe == DEFAULT else [f"recipe={recipe}"])
        dep = m.get("deploy")
        row = {"recipe": recipe, "beyond_stock": sorted(dep["beyond_stock"]) if dep else None,
               "delegates": dep["delegates"] if dep else None, "runners": dep["runners"] if dep else None}
        if dep is None or "programs" in m:
            row["note"] = "the transformers route's prefill + decode programs (our Python runner)"
            rows.append(row)
            continue
        runs_native = "llm_runner" in dep["runners"]["runners"]
        if dep["runners"]["text_llm_runner"]:
            et = text_llm_runner(m, args.new)
            row["text_llm_runner"] = et
            if "error" not in et:
                row["text_llm_runner_equal"] = et["generated_ids"] == x86(m, et["prompt_ids"], args.new)
        if runs_native:
            ids = native.encode(m["tokenizer"], PROMPT, "0")
            ref, arm = x86(m, ids, args.new), aarch64(m, ids, args.new)
            row["aarch64"] = {"x86": ref, "arm": arm.get("generated_ids"), "error": arm.get("error"),
                              "equal": arm.get("generated_ids") == ref}
        rows.append(row)
    print("\n| recipe | beyond ExecuTorch's stock libraries | TextLLMRunner | aarch64 (QEMU) |\n|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| `{r['recipe']}` | - | not built here ({r['skipped']}) | - |")
            continue
        beyond = ", ".join(f"`{op}`" for op in r["beyond_stock"] or []) or "none"
        # a delegate this CPU build of ExecuTorch does not carry (MLX: Apple Silicon's)
        beyond += "".join(f"; delegate `{d}`" for d in r.get("delegates") or [] if d != "XnnpackBackend")
        et = r.get("text_llm_runner")
        et_cell = ("no: " + r["runners"]["text_llm_runner_why"] if r["runners"] and not r["runners"]["text_llm_runner"]
                   else r.get("note", "-") if et is None
                   else f"error: {et['error'][:80]}" if "error" in et
                   else f"yes, {'tokens equal llm_runner' if r['text_llm_runner_equal'] else 'tokens DIFFER'}")
        a = r.get("aarch64")
        arm_cell = ("not in llm_runner" if a is None else f"error: {a['error']}" if a["error"]
                    else f"yes, {'x86 tokens' if a['equal'] else 'parts from x86 at a near-tie'}")
        print(f"| `{r['recipe']}` | {beyond} | {et_cell} | {arm_cell} |")
    write_results("deploy_table", rows)


if __name__ == "__main__":
    main()
