"""Does the verify gate tell right from wrong? Correct builds of both models in several schemes, and deliberately
broken variants of them (export.fault: a late layer's rows permuted, one group's scale doubled, two query heads
swapped, the rings one slot short), each verified; prints every build's figures against its same-quantization
reference and the gate's verdict, and the margin between the worst correct build and the best broken one per gate.

    python bench/gate_calibration.py                       # both models (several hours cold: each build lowers)
    python bench/gate_calibration.py --models smollm2

The thresholds (conf/verify/default.yaml) are set from this table; its figures are written beside them.
Writes outputs/bench/gate.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import ROOT

# per model: build name -> (pipeline overrides, the faults to break it with)
FAULTS = ("layer_permuted", "group_scale_doubled", "heads_swapped")
GOOD = {
    "smollm2": {
        "fp32 (smollm2_custom, quantize=none)": (["recipe=smollm2_custom", "quantize=none"], FAULTS),
        "default (python -m pipeline: 8da4w_gptq, custom)": ([], FAULTS),
        "8da4w (smollm2_custom)": (["recipe=smollm2_custom"], ("layer_permuted",)),
    },
    "gemma3": {
        # chunk 128: the builds the tests make (rings of 512 + 128 - 1 slots)
        "fp32 custom (gemma3_custom, chunk 128, rings)": (["recipe=gemma3_custom", "export.prefill_chunk=128"],
                                                          ("ring_one_short",)),
        "8da4w_mixed (gemma3_offgraph_8da4w, quantize=8da4w_mixed)": (
            ["recipe=gemma3_offgraph_8da4w", "quantize=8da4w_mixed"], ()),
        "fp32 (gemma3_offgraph, chunk 128)": (["recipe=gemma3_offgraph", "export.prefill_chunk=128"], ()),
    },
}
FIGURES = ("greedy_match", "greedy_total", "max_logit_err", "top1", "kld")


def verify(overrides: list[str]) -> dict:
    """Build and verify; the gate's verdict and the report's figures, whether it passed or not."""
    r = subprocess.run([sys.executable, "-m", "pipeline", *overrides, "run.progress=false"], cwd=ROOT,
                       capture_output=True, text=True)
    lines = r.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("manifest: "):
        sys.exit(f"build {' '.join(overrides)} did not reach verify:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    run = Path(lines[-1].split(": ", 1)[1]).parent
    report = next((p for p in (run / "verify" / "report.json", run / "failed-verify" / "report.json")
                   if p.exists()), None)
    if report is None:  # verify stopped before its report: the program itself refused to run (e.g. a ring
        # too short for a position); still a failed verify, with no figures
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
        if not errors or "stage verify failed" not in errors[-1]:
            sys.exit(f"build {' '.join(overrides)} failed before verify:\n{r.stderr[-2000:]}")
        return {"passed": False, "gate": None, **{k: None for k in FIGURES}, "floor_kld": None,
                "problems": [errors[-1][len("error: "):]]}
    rep = json.loads(report.read_text())
    same = rep["summary"].get("same_quant") or _summarize(rep["prompts"])
    floor = rep["summary"].get("floor") or _summarize(rep["prompts"], "floor", greedy=False)
    return {"passed": rep["passed"], "gate": rep["summary"].get("gate"), **{k: same[k] for k in FIGURES},
            "floor_kld": floor["kld"] if floor else None,
            "problems": [x for p in rep["problems"] for x in p["problems"]][:4]}


def _summarize(prompts: list, key: str = "same_quant", greedy: bool = True) -> dict | None:
    """A failed verify's report keeps the per-prompt figures only."""
    from pipeline.stages.verify import teacher_forced_summary
    if not all(key in p for p in prompts):
        return None
    counts = {"greedy_match": sum(p[key]["greedy_match"] for p in prompts),
              "greedy_total": sum(len(p["reference"]) for p in prompts)} if greedy else {}
    return {**counts, **teacher_forced_summary(prompts, key)}


def table(rows: list[dict]) -> str:
    """The broken-variant table: each build's figures against its same-quantization reference, and the verdict."""
    lines = ["| model | build | fault | gate | greedy | max abs dlogit | top-1 | KLD | floor | KLD / floor | verdict |",
             "|" + "---|" * 11]
    for r in rows:
        if r["kld"] is None:  # the program refused to run: no figures, the error instead
            lines.append(f"| {r['model']} | {r['build']} | {r['fault'] or '(correct)'} | - | - | - | - | - | - | - | "
                         f"FAIL: {r['problems'][0].split(' (manifest')[0]} |")
            continue
        floor = r.get("floor_kld")
        ratio = f"{r['kld'] / floor:.2f}" if floor else "-"
        lines.append(f"| {r['model']} | {r['build']} | {r['fault'] or '(correct)'} | {r['gate']} | "
                     f"{r['greedy_match']}/{r['greedy_total']} | {r['max_logit_err']:.3g} | {r['top1']:.3f} | "
                     f"{r['kld']:.3g} | {f'{floor:.3g}' if floor else '-'} | {ratio} | "
                     f"{'pass' if r['passed'] else 'FAIL'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--only", help="only the builds whose name contains this")
    ap.add_argument("--redo", action="store_true", help="verify again the variants gate.json already holds")
    ap.add_argument("--print", action="store_true", help="print the table of gate.json, verify nothing")
    args = ap.parse_args()
    out = ROOT / "outputs" / "bench" / "gate.json"
    rows = json.loads(out.read_text()) if out.exists() else []
    if args.print:
        print(table(rows))
        return
    for model in args.models.split(","):
        for name, (overrides, faults) in GOOD[model].items():
            if args.only and args.only not in name:
                continue
            for fault in (None, *faults):
                if not args.redo and any((r["model"], r["build"], r["fault"]) == (model, name, fault) for r in rows):
                    continue
                row = {"model": model, "build": name, "fault": fault,
                       **verify(overrides + ([f"export.fault={fault}"] if fault else []))}
                rows = [r for r in rows if (r["model"], r["build"], r["fault"]) != (model, name, fault)] + [row]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(rows, indent=2))
                if row["kld"] is None:
                    print(f"{model:8} {name:34} {str(fault):20} fail  {row['problems'][0]}", flush=True)
                    continue
                print(f"{model:8} {name:34} {str(fault):20} {'PASS' if row['passed'] else 'fail'}  gate {row['gate']}"
                      f"  greedy {row['greedy_match']}/{row['greedy_total']}  max|dlogit| {row['max_logit_err']:.3g}"
                      f"  top-1 {row['top1']:.3f}  KLD {row['kld']:.3g}"
                      + (f"  floor {row['floor_kld']:.3g} (x{row['kld'] / max(row['floor_kld'], 1e-12):.2f})"
                         if row["floor_kld"] is not None else ""), flush=True)
    for gate in sorted({r["gate"] for r in rows if r["gate"]}):
        good = [r for r in rows if r["gate"] == gate and r["fault"] is None]
        bad = [r for r in rows if r["gate"] == gate and r["fault"] is not None and r["kld"] is not None]
        if good and bad:
            print(f"\ngate {gate}: worst correct KLD {max(r['kld'] for r in good):.3g}, top-1 "
                  f"{min(r['top1'] for r in good):.3f}; best broken KLD {min(r['kld'] for r in bad):.3g}, top-1 "
                  f"{max(r['top1'] for r in bad):.3f}; broken builds passed: {sum(r['passed'] for r in bad)}")
            ratio = [r for r in good + bad if r.get("floor_kld")]
            if ratio:
                x = {id(r): r["kld"] / r["floor_kld"] for r in ratio}
                worst = max((x[id(r)] for r in ratio if r in good), default=float("nan"))
                best = min((x[id(r)] for r in ratio if r in bad), default=float("nan"))
                print(f"  KLD over the numerics floor: worst correct x{worst:.2f}, best broken x{best:.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
