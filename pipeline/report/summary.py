"""The one-screen summary at the end of a build; its last two lines are `pte:` and `manifest:`."""
from __future__ import annotations

from pathlib import Path

from pipeline import ops


def _size(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _entry_bytes(path: str | None) -> int | None:
    if not path:
        return None
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _tied(m: dict) -> str:
    """How the program holds a tied embedding (export's record), for the bits/weight line."""
    info = next((s.get("metrics") or {} for s in m["stages"] if s["name"] == "export"), {})
    if "tied_head" not in info:
        return ""
    return "; the tied embedding stored once (llmpipe::tied_head)" if info["tied_head"] else \
        f"; the tied embedding not shared ({info['tied_head_why']})"


def print_summary(m: dict) -> None:
    print()
    print(f"recipe {m['recipe']}  build {m['build_hash']}  status {m['status']}  {m['seconds']:.1f}s")
    print(f"  {'stage':<9} {'cache':<6} {'seconds':>8} {'built in':>9} {'peak RSS':>10} {'size':>10}  key")
    for s in m["stages"]:
        built = s.get("built_seconds")
        rss = s.get("peak_rss_mib")
        print(f"  {s['name']:<9} {s.get('cache', '-'):<6} {s.get('seconds', 0):>8.1f} "
              f"{(f'{built:.1f}' if built is not None else '-'):>9} "
              f"{(f'{rss:.0f} MiB' if rss else '-'):>10} {_size(_entry_bytes(s.get('path'))):>10}  "
              f"{s['key'][:12]}{'  FAILED' if s.get('status') == 'failed' else ''}")
    quant = next((s for s in m["stages"] if s["name"] == "quantize" and s.get("metrics")), None)
    w = (quant or {}).get("metrics", {}).get("weights")
    if w and w["quantized"]:
        gptq = f", {w['gptq']} rounded by GPTQ" if w.get("gptq") else ""
        print(f"  quantized weights {w['quantized']} ({w['carried']} carrying the source's own grid{gptq}), "
              f"re-quantization cost: relative RMS {w['requantized_rel_rms_mean']:.3g} mean, {w['rel_rms_max']:.3g} max")
    plan = (quant or {}).get("metrics", {}).get("plan")
    if plan:
        print(f"  plan for {plan['target_bpw']} bits/weight: predicted {plan['predicted_bpw']:.2f} bits/weight, KLD "
              f"{plan['predicted_kld']:.4g} (each linear's cost alone, summed), {plan['by_scheme']}; as a recipe: "
              f"quantize.json plan.recipe")
    lower = next((s for s in m["stages"] if s["name"] == "lower" and s.get("metrics")), None)
    params = (quant or {}).get("metrics", {}).get("parameters")
    if lower and params and lower["metrics"].get("pte_bytes"):
        files = [Path(lower["path"]) / name for name in lower["metrics"].get("data", ())]
        data = sum(f.stat().st_size for f in files if f.exists())
        total = lower["metrics"]["pte_bytes"] + data
        print(f"  program {_size(total)}: {total * 8 / params:.2f} bits/weight over {params / 1e6:.1f}M parameters"
              f"{_tied(m)}")
        if data:  # an adapter kept apart: the base's weights in the data file(s), which other adapters share
            shared = lower["metrics"].get("data_shared_with") or {}
            print(f"  of which {', '.join(lower['metrics']['data'])} {_size(data)} (the base's weights"
                  + (", one file with another adapter's build)" if shared else ")")
                  + f", model.pte {_size(lower['metrics']['pte_bytes'])} (the adapter and the program)")
    if lower:
        mt = lower["metrics"]
        print(f"  delegated nodes {mt.get('delegated_nodes')}, outside the delegate {mt.get('non_delegated_nodes')}"
              + (f"; per forward: {mt['delegate_calls']} delegate calls, {mt['portable_ops']} portable ops"
                 if "delegate_calls" in mt else ""))
        outside = {op: c["non_delegated"] for op, c in (mt.get("delegation_by_op") or {}).items()
                   if c["non_delegated"] and op != "getitem"}
        if outside:
            print(f"  outside the delegate, by op: {outside}")
    dep = m.get("deploy")
    if dep:
        print(f"  operators: {ops.describe(dep)}")
        r = dep["runners"]
        print(f"  runs in: {', '.join(r['runners'])}"
              + ("" if r["text_llm_runner"] else f"; not ExecuTorch's TextLLMRunner: {r['text_llm_runner_why']}"))
    v = m.get("verify")
    if v and v.get("gate"):
        print(f"  verify gate: {v['gate']}")
    if v:
        for key, label in (("same_quant", "vs same-quant reference"), ("vs_float", "vs float eager"),
                           ("quant_cost", "(reference vs float)"), ("floor", "(numerics floor)")):
            f = v.get(key)
            if not f:
                continue
            greedy = f"greedy {f['greedy_match']}/{f['greedy_total']}" if "greedy_total" in f else "teacher-forced"
            print(f"  verify {label:<20} {greedy}  max|dlogit| {f['max_logit_err']:.3g}  top-1 {f['top1']:.3f}  "
                  f"KLD {f['kld']:.3g}")
    fid = (v or {}).get("fidelity")
    if fid:
        print(f"  fidelity on {fid['tokens']} corpus tokens: KLD mean {fid['kld_mean']:.4g}, p99 {fid['kld_p99']:.3g}, "
              f"same top-1 {100 * fid['same_top1']:.1f} %, PPL {fid['ppl']:.3f} (float {fid['ppl_float']:.3f})")
    if v and v.get("runtime"):
        cross = f"; also compared with the {v['cross_check']} runtime" if v.get("cross_check") else ""
        print(f"  verify ran on {v['runtime']}{cross}")
    if v and str(v.get("status", "")).startswith("unsupported"):
        print(f"  verify status: {v['status']} (checks skipped)")
    nat = (v or {}).get("native")
    if nat:
        tie = nat.get("near_tie_gap")
        same = "identical to the Python runtime" if nat["token_parity"] else "DIFFER from the Python runtime" \
            if tie is None else f"as the Python runtime's up to near-ties (twinned kernels: a pick {tie:.3g} below the best)"
        print(f"  C++ runner: tokens {same}, "
              f"prefill {nat['prefill_tok_s'] or 0:.0f} tok/s, decode {nat['decode_tok_s'] or 0:.1f} tok/s, "
              f"peak RSS {nat['peak_rss_mib'] or 0:.0f} MiB")
    bat = (v or {}).get("batched")
    if bat:
        print(f"  batched runner: {bat['sessions']} sessions {'equal' if bat['parity'] else 'DIFFER from'} their "
              f"single-session runs, {bat['rows_per_forward']:.2f} rows per forward")
    if m.get("programs"):  # a route that builds several programs (transformers: prefill + decode, KV cache as I/O)
        print("  programs: " + ", ".join(f"{n} {_size(Path(p).stat().st_size)}" for n, p in m["programs"].items())
              + " (transformers.exporters layout; ExportedModel.from_pretrained(pte folder))")
    if m.get("pte"):
        print(f"pte: {m['pte']}")
    print(f"manifest: {m.get('run_manifest', '(not written)')}")
