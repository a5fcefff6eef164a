"""Decode with the runner's weights on 2 MiB pages (`--huge-pages on`, the default) against 4 KiB pages (`off`), for
the default build and each model's fastest recipe, at 1 and 2 threads, in alternating runs (a benchmark, not a test).

    python bench/huge_pages.py                      # 3 rounds, 128 tokens after a 16-token prompt
    python bench/huge_pages.py --rounds 5 --builds gemma3 --threads 1

Why it matters: decode streams every weight once a token, and on 4 KiB pages the hardware prefetcher stops at each
page boundary (native/src/platform/huge_pages.h). Prints median decode tok/s and the ratio on/off per build and
thread count; writes outputs/bench/huge_pages.json.
"""
from __future__ import annotations

import argparse
import json
import statistics

from common import ROOT, build  # noqa: E402  (bench/ is the script's folder)

BUILDS = {"default": [], "smollm2": ["recipe=smollm2_custom"], "gemma3": ["recipe=gemma3_offgraph_8da4w"]}


def decode(m: dict, threads: int, huge: str, new: int) -> dict:
    from pipeline import native
    extra = ["--ignore-eos", "--warmup", "--threads", str(threads), "--huge-pages", huge, *native.cache_args(m)]
    s = native.run(m["pte"], m["tokenizer"], prompt_ids=list(range(100, 116)), max_new_tokens=new, extra_args=extra)
    return {"decode_tok_s": s["decode_tok_s"], "huge_pages_mib": s["huge_pages_mib"], "peak_rss_mib": s["peak_rss_mib"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--builds", default=",".join(BUILDS), help=f"comma list of {list(BUILDS)}")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    a = ap.parse_args()
    names, threads = a.builds.split(","), [int(t) for t in a.threads.split(",")]
    manifests = {name: build(BUILDS[name]) for name in names}  # run manifests: pte, tokenizer, config
    results: dict = {}
    for _ in range(a.rounds):
        for name in names:
            for t in threads:
                for huge in ("off", "on"):  # alternating, so a slow spell of the machine hits both
                    results.setdefault(f"{name} t{t} {huge}", []).append(decode(manifests[name], t, huge, a.new_tokens))
    table = {}
    print("| build | threads | decode off | decode on | on / off | on 2 MiB pages | peak RSS off / on MiB |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        for t in threads:
            off, on = results[f"{name} t{t} off"], results[f"{name} t{t} on"]
            mo = statistics.median(r["decode_tok_s"] for r in off)
            mn = statistics.median(r["decode_tok_s"] for r in on)
            row = {"off": mo, "on": mn, "ratio": mn / mo, "huge_pages_mib": on[-1]["huge_pages_mib"],
                   "peak_rss_mib": [max(r["peak_rss_mib"] for r in off), max(r["peak_rss_mib"] for r in on)]}
            table[f"{name} t{t}"] = row
            print(f"| {name} | {t} | {mo:.1f} | {mn:.1f} | x{mn / mo:.2f} | {row['huge_pages_mib']:.0f} MiB | "
                  f"{row['peak_rss_mib'][0]:.0f} / {row['peak_rss_mib'][1]:.0f} |")
    out = ROOT / "outputs" / "bench" / "huge_pages.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rounds": a.rounds, "new_tokens": a.new_tokens, "table": table, "runs": results},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
