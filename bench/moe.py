"""Decode cost of a mixture-of-experts model against a dense model with the same active parameters, through our C++
runner, in one invocation with alternating runs (a benchmark, not a test).

    python bench/moe.py                                   # fp32 and 8da4w, 1 and 2 threads, 3 rounds
    python bench/moe.py --schemes 8da4w --threads 2 --rounds 5
    python bench/moe.py --hidden 1024 --expert-width 2048 --schemes 8da4w   # weights past the last-level cache
    python bench/moe.py --stock --schemes 8da4w --threads 2    # also the MoE on ExecuTorch's ops (cache=stock)

MoE: a random Mixtral, hidden 512, 8 experts of width 1024, top-2 (a token runs 2 x 3 x 512 x 1024 expert weights,
through llmpipe::experts). Dense: a random Llama of the same geometry with an MLP of width 2048 (3 x 512 x 2048: the
same active parameters, through XNNPACK). Both 8 layers, 8 query heads (2 KV), the custom cache, vocabulary 512, the
same quantization, the same 64-token prompt, 128 new tokens. Prints decode tok/s (median of the rounds) and the ratio
MoE / dense; writes outputs/bench/moe_<hidden>_<width>.json. --stock adds the MoE with cache=stock, whose program holds
no op of ours: every expert runs on every token as plain linears (pipeline/model/layers/experts.py DenseExperts).
"""
from __future__ import annotations

import argparse
import json
import statistics

from common import ROOT, build  # noqa: E402  (bench/ is the script's folder)

GEOMETRY = ["model=tiny_llama", "model.random.num_hidden_layers=8", "model.random.num_attention_heads=8",
            "model.random.num_key_value_heads=2", "export.max_context_len=512"]


def models(hidden: int, width: int, stock: bool = False) -> dict[str, list[str]]:
    """The MoE (8 experts of `width`, top-2) and the dense model of the same active parameters (an MLP of 2 x width);
    with `stock`, the MoE again on ExecuTorch's ops alone (its experts dense)."""
    dims = [f"model.random.hidden_size={hidden}", f"model.random.head_dim={hidden // 8}"]
    moe = dims + ["model.random.arch=mixtral", f"model.random.intermediate_size={width}"]
    out = {"moe": moe + ["cache=custom"],
           "dense": dims + ["model.random.arch=llama", f"model.random.intermediate_size={2 * width}", "cache=custom"]}
    return {**out, "moe_stock": moe + ["cache=stock"]} if stock else out


def decode_tok_s(m: dict, threads: int, new: int) -> float:
    from pipeline import native
    ids = list(range(3, 67))  # 64 prompt tokens
    s = native.run(m["pte"], m["tokenizer"], prompt_ids=ids, max_new_tokens=new,
                   extra_args=["--ignore-eos", "--warmup", "--threads", str(threads)])
    return s["decode_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="none,8da4w", help="quantize options (conf/quantize), comma-separated")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-width", type=int, default=1024)
    ap.add_argument("--stock", action="store_true", help="also the MoE with cache=stock (every expert, every token)")
    a = ap.parse_args()
    results = {}
    for scheme in a.schemes.split(","):
        builds = {name: build(GEOMETRY + extra + [f"quantize={scheme}"])
                  for name, extra in models(a.hidden, a.expert_width, a.stock).items()}
        for threads in map(int, a.threads.split(",")):
            runs = {name: [] for name in builds}
            for _ in range(a.rounds):  # alternating, so drift hits both alike
                for name, m in builds.items():
                    runs[name].append(decode_tok_s(m, threads, a.new_tokens))
            med = {name: statistics.median(xs) for name, xs in runs.items()}
            results[f"{a.hidden}/{a.expert_width} {scheme} t{threads}"] = {"decode_tok_s": med, "runs": runs, "ratio": med["moe"] / med["dense"]}
            print(f"{scheme:6} {threads} thread(s): MoE {med['moe']:8.1f} tok/s, dense {med['dense']:8.1f} tok/s, "
                  f"MoE / dense x{med['moe'] / med['dense']:.2f}", flush=True)
            if "moe_stock" in med:
                print(f"{'':6} {threads} thread(s): MoE on ExecuTorch's ops (dense experts) {med['moe_stock']:8.1f} tok/s, "
                      f"x{med['moe_stock'] / med['moe']:.2f} the routed MoE", flush=True)
    out = ROOT / "outputs" / "bench" / f"moe_{a.hidden}_{a.expert_width}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
