"""verify: run the built program in its runtime (pipeline/runtimes) and measure it against eager, on fixed prompts.

    python -m pipeline recipe=smollm2_xnnpack_8da4w verify.max_new_tokens=32

Two references: the eager module with the same quantization, as the backend computes it (did export and lowering
preserve the program? tight thresholds), and the unquantized eager module (what did quantization cost? looser).
Figures per prompt: greedy token match over N new tokens, and teacher-forced over the reference's tokens (so one
early drift does not hide everything after it): max abs logit error, top-1 agreement, mean KL divergence.
Thresholds: the gate that fits the quantization (verify.gate, conf/verify). Then, where they run the program, the
C++ runners on the same prompt ids: their greedy tokens must equal the Python runtime's.
"""
from __future__ import annotations

import json
import logging

import torch
import torch.nn.functional as F

from pipeline import native, ops
from pipeline.abi import EOS_IDS, KV_DTYPES
from pipeline.backends import BACKENDS
from pipeline.config import v
from pipeline.model import adapter
from pipeline.model.cache_modes import CACHE_MODES
from pipeline.model.cache_modes import flags as cache_flags
from pipeline.model.layers.lora import attach_adapter
from pipeline.model.layers.row_embedding import rows_only
from pipeline.model.quant.float_noise import float_noise
from pipeline.model.quant.resolve import dynamic_activations
from pipeline.model.quant.smoothing import SCALES_FILE
from pipeline.report.progress import bar, spinner
from pipeline.runtimes import RUNTIMES, CachePolicy, Unsupported, open_program, program_info
from pipeline.runtimes.base import run_rows, run_sequence

NAME, VERSION = "verify", 1
AFTER = ("download", "wrap", "quantize", "lower")
CONFIG_KEYS = ("verify",)
HALF = ("fp16", "bf16")  # export.dtype values the `half` gate applies to
SOURCES = ("native/src", "native/CMakeLists.txt",  # the C++ runners it checks against
           "bench/corpus/python-reference.txt")     # the long prompt and the fidelity chunks

log = logging.getLogger(__name__)


class VerifyFailed(RuntimeError):
    pass


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer(prompt)["input_ids"]


@torch.no_grad()
def greedy(module, ids: list[int], n: int, chunk: int, eos: set[int],
           guess: list[int] = ()) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decode n tokens (stops early at EOS); returns the tokens and each step's logits.

    `guess`: tokens the module will likely pick (another runtime's greedy output). An eager module then takes the
    next token and the guess's continuation in one call (run_rows), keeping the rows whose fed tokens equal what
    it picks: the same tokens and logits as one step per call, in a few calls instead of n (an eager quantized
    module's call costs about as much for 16 rows as for 1). At most `chunk` tokens go past the accepted prefix,
    so a ring of window + chunk - 1 slots still holds what the next step attends to."""
    out, steps = [], []
    rows, fed = [run_sequence(module, ids, chunk)], []
    while True:
        for j, logits in enumerate(rows):
            if j > 0 and fed[j] != out[-1]:  # the guess went wrong: later rows followed a token greedy did not pick
                break
            tok = int(logits.argmax())
            steps.append(logits)
            out.append(tok)
            if tok in eos or len(out) == n:
                return out, steps
        k = len(out)
        fed = [out[-1], *guess[k:k + min(chunk, n - k) - 1]]
        rows = run_rows(module, fed, chunk, start=len(ids) + k - 1)


@torch.no_grad()
def teacher_forced(module, ids: list[int], targets: list[int], chunk: int,
                   prefilled: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Logits predicting each target, feeding the targets themselves (not the module's own choices).
    `prefilled`: the module's cache holds ids already (a run over them came last) and these are its logits after
    them, so the prompt is not fed again."""
    first = run_sequence(module, ids, chunk) if prefilled is None else prefilled
    return [first, *run_rows(module, targets[:-1], chunk, start=len(ids))]


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    r, g = torch.stack(ref).float(), torch.stack(got).float()
    kld = F.kl_div(F.log_softmax(g, -1), F.log_softmax(r, -1), log_target=True, reduction="none").sum(-1)
    return {"max_logit_err": (r - g).abs().max().item(),
            "top1": (r.argmax(-1) == g.argmax(-1)).float().mean().item(),
            "kld": max(0.0, kld.mean().item())}  # rounding can make ~0 negative


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def leading_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def check(figures: dict, th, n_ref: int, label: str) -> list[str]:
    problems = []
    need = th.min_greedy_match
    if need is not None:
        need = n_ref if need < 0 else min(need, n_ref)
        if figures["greedy_match"] < need:
            problems.append(f"{label}: greedy match {figures['greedy_match']}/{n_ref} < {need}")
    if th.max_logit_err is not None and figures["max_logit_err"] > th.max_logit_err:
        problems.append(f"{label}: max logit error {figures['max_logit_err']:.4g} > {th.max_logit_err}")
    if th.min_top1 is not None and figures["top1"] < th.min_top1:
        problems.append(f"{label}: top-1 agreement {figures['top1']:.3f} < {th.min_top1}")
    if th.max_kld is not None and figures["kld"] > th.max_kld:
        problems.append(f"{label}: mean KLD {figures['kld']:.4g} > {th.max_kld}")
    return problems


def cache_policy(ctx) -> CachePolicy:
    """verify.runtime: the runtime-owned cache policy an off-graph program runs under."""
    rt = ctx.cfg.verify.runtime
    return CachePolicy(capacity=rt.kv_max_capacity or ctx.cfg.export.max_context_len,
                       initial_capacity=rt.kv_initial_capacity,
                       windows=list(rt.kv_windows) if rt.kv_windows is not None else None,
                       kv_dtype=KV_DTYPES[v(rt.kv_storage_dtype)] if rt.kv_storage_dtype is not None else None)


def native_args(ctx) -> list[str]:
    """The runner flags of verify.runtime (modes whose cache the runtime owns)."""
    return native.kv_args(cache_policy(ctx)) if CACHE_MODES[ctx.cfg.cache.mode].RUNTIME_OWNED else []


def program_file(ctx):
    return ctx.inputs["lower"] / program_info(ctx.inputs["lower"])["file"]


def twinned_kernels(ctx) -> bool:
    """The C++ runner runs twins of some of the program's kernels (native/'s of ExecuTorch's llama:: ops), where the
    Python runtime runs the originals: the same function, other float bits."""
    return any(ops.LIBRARIES[k].twinned for k in program_info(ctx.inputs["lower"]).get("kernels", ())
               if k in ops.LIBRARIES)


def near_tie_gap(pte, ids: list[int], tokens: list[int], chunk: int) -> float:
    """How far below the Python runtime's best logit another runner's greedy pick sat, at its worst step
    (teacher-forced on that runner's own tokens): 0 where it picked the same."""
    rows = teacher_forced(pte, ids, tokens, chunk)
    return max(float(r.float().max() - r.float().reshape(-1)[t]) for r, t in zip(rows, tokens))


def native_check(ctx, ids: list[int], n: int) -> dict:
    """Greedy through the C++ runner on the same prompt ids; returns its tokens and speed figures."""
    stats = native.run(program_file(ctx), ctx.inputs["download"] / "model" / "tokenizer.json",
                       prompt_ids=ids, max_new_tokens=n, extra_args=native_args(ctx))
    keep = ("prefill_tok_s", "decode_tok_s", "ttft_ms", "load_ms", "peak_rss_mib", "cache_report", "cache_bytes")
    return {"generated_ids": list(stats["generated_ids"]), **{k: stats.get(k) for k in keep}}


def batched_check(ctx, all_ids: list[list[int]], singles: list[list[int]]) -> dict:
    """The prompts as concurrent sessions of llm_batched_runner: each must generate what its single-session
    C++ run generated (greedy), while sharing forwards."""
    gens, engine = native.run_batched(program_file(ctx), all_ids, max_new_tokens=max(len(s) for s in singles),
                                      extra_args=native.kv_args(cache_policy(ctx), batched=True))
    equal = [g["generated_ids"][:len(s)] == s for g, s in zip(gens, singles)]
    return {"sessions": len(gens), "parity": all(equal), "equal": equal, "forwards": engine["forwards"],
            "rows_per_forward": engine["rows_per_forward"], "decode_tok_s": engine["decode_tok_s"]}


def unsupported_status(ctx, err: Unsupported) -> dict:
    """A program the runtime cannot run (e.g. an instruction the MLX interpreter has no handler for): never a
    silent pass."""
    status = f"unsupported: {err.op}"
    report = {"prompts": [], "summary": {"status": status}, "problems": [{"prompt": "(program)",
              "problems": [str(err)], "reference_text": "", "pte_text": ""}], "passed": False}
    (ctx.out / "report.json").write_text(json.dumps(report, indent=2))
    ctx.info["verify_report"] = report
    if ctx.cfg.verify.fail_on_unsupported:
        runtime = RUNTIMES[program_info(ctx.inputs["lower"])["runtime"]].describe()
        raise VerifyFailed(f"verify gate failed: {status}: {runtime} cannot run this program "
                           "(verify.fail_on_unsupported=false records it and skips the checks)")
    log.warning("verify %s: checks skipped (verify.fail_on_unsupported=false)", status)
    return {"status": status}


def cross_check_module(ctx):
    """Another runtime this machine has for the program (the real MLX runtime on a Mac), or None."""
    other = BACKENDS[ctx.cfg.backend.name].cross_check_runtime(v(ctx.cfg.cache.mode))
    return None if other is None else (other, open_program(ctx.inputs["lower"], runtime=other))


def gate_of(cfg) -> str:
    """The gate that applies: verify.gate, or with `auto` the one that fits the quantization scheme."""
    choice = v(cfg.verify.gate)
    if choice == "auto":
        if dynamic_activations(cfg.quantize):
            return "dynamic"
        return "half" if v(cfg.export.dtype) in HALF else "exact"
    return choice


def verify_prompts(ctx, tok) -> list[tuple[str, list[int]]]:
    """(label, token ids) of every prompt: the configured ones, then the long one that crosses the chunk and, on a
    model with sliding windows, wraps every window's ring (window + chunk - 1 slots), so a misplaced ring shows."""
    vc, e = ctx.cfg.verify, ctx.cfg.export
    prompts = [(text, prompt_ids(tok, text, vc.chat)) for text in vc.prompts]
    if vc.long_prompt:
        from pipeline.fidelity import corpus_chunks
        window = ctx.geometry.smallest_window if ctx.geometry is not None else None
        n = e.prefill_chunk + 16 if window is None else window + e.prefill_chunk + 16
        n = min(n, e.max_context_len - vc.max_new_tokens)
        ids = corpus_chunks(tok, n, 1)[0]
        prompts.append((f"(bench/corpus prose, {n} tokens)", ids))
    return prompts


def check_prompts(ctx, tok, pte, reference, eager_f, eos, other, floor=None) -> tuple[list, list]:
    """Each prompt: the program against the same-quantization reference (the eager module as the backend computes
    it) and against the float model (and the other runtimes that apply); with `floor` (a generator), the reference
    against itself with last-bit float noise drawn from it, on the same tokens (the numerics floor)."""
    vc, chunk = ctx.cfg.verify, ctx.cfg.export.prefill_chunk
    gate = vc[gate_of(ctx.cfg)]
    no_windows = ctx.geometry is not None and ctx.geometry.smallest_window is None  # the model has no sliding layers
    rings = CACHE_MODES[ctx.cfg.cache.mode].rings(cache_flags(ctx.cfg.cache))
    # a recurrent state cannot step back: no runs ahead on a guess, no stepping back to the prompt's end
    recurrent = ctx.geometry is not None and ctx.geometry.recurrent
    twins = vc.native and twinned_kernels(ctx)
    prompts, problems = [], []
    for text, ids in bar(verify_prompts(ctx, tok), desc="verify prompts", enabled=ctx.progress):
        room = ctx.cfg.export.max_context_len - len(ids)
        n = min(vc.max_new_tokens, room)
        if n < 1:
            raise VerifyFailed(f"verify.prompts: {text!r} is {len(ids)} tokens, no room in the context")
        got, got_logits = greedy(pte, ids, n, chunk, eos)
        guess = () if recurrent else got
        ref, ref_logits = greedy(reference, ids, n, chunk, eos, guess=guess)
        # later runs of the same module step back to the end of the prompt it holds, n - 1 positions: a ring of
        # window + chunk - 1 slots still holds the window there while n <= chunk; other sliding caches start over
        steps_back = not recurrent and (no_windows or (rings and n <= chunk))
        pte_first, ref_first = (got_logits[0], ref_logits[0]) if steps_back else (None, None)
        same = {"greedy_match": leading_match(ref, got),
                **compare(ref_logits, teacher_forced(pte, ids, ref, chunk, pte_first))}
        flt, flt_logits = greedy(eager_f, ids, n, chunk, eos, guess=guess)
        vs_float = {"greedy_match": leading_match(flt, got),
                    **compare(flt_logits, teacher_forced(pte, ids, flt, chunk, pte_first))}
        # what quantization itself costs (eager, same tokens): the program should cost no more
        cost = vs_float if reference is eager_f else \
            {"greedy_match": leading_match(flt, ref),
             **compare(flt_logits, teacher_forced(reference, ids, flt, chunk, ref_first))}
        entry = {"prompt": text, "prompt_tokens": len(ids), "prompt_ids": ids, "reference": ref, "pte": got, "float_reference": flt,
                 "reference_text": tok.decode(ref), "pte_text": tok.decode(got), "float_text": tok.decode(flt),
                 "same_quant": same, "vs_float": vs_float, "quant_cost": cost}
        if floor is not None:
            with float_noise(reference, floor):
                entry["floor"] = compare(ref_logits, teacher_forced(reference, ids, ref, chunk))
        found = (check(same, gate.same_quant, len(ref), "vs same-quant reference") if gate.same_quant.per_prompt
                 else []) + (check(vs_float, gate.vs_float, len(flt), "vs float eager") if gate.vs_float.per_prompt
                             else [])
        ratio = gate.vs_float.max_kld_ratio
        if ratio is not None and vs_float["kld"] > ratio * cost["kld"] + 1e-3:  # 1e-3: noise floor near 0
            found.append(f"vs float eager: KLD {vs_float['kld']:.4g} > {ratio} x the same-quant reference's "
                         f"{cost['kld']:.4g}")
        if other is not None:  # e.g. on a Mac: the real MLX runtime must agree with the interpreter
            name, module = other
            entry["cross_check"] = {"runtime": name, "generated_ids": greedy(module, ids, n, chunk, eos)[0]}
            if entry["cross_check"]["generated_ids"] != got:
                found.append(f"runtime {name} vs the program's own runtime: tokens differ")
        if vc.native:
            entry["native"] = native_check(ctx, ids, n)
            cpp = entry["native"]["generated_ids"]
            if cpp != got and twins:
                # other float bits may pick another token at a near-tie: no further from the best than last-bit noise
                # moves a logit (the numerics floor's; without one, the gate's own tolerance)
                margin = entry["floor"]["max_logit_err"] if "floor" in entry else gate.same_quant.max_logit_err or 0
                gap = entry["native"]["near_tie_gap"] = near_tie_gap(pte, ids, cpp, chunk)
                if gap > margin:
                    found.append(f"C++ runner (twinned kernels) vs Python runtime: a pick {gap:.3g} below the best "
                                 f"logit (> {margin:.3g}, what last-bit noise moves one)\n"
                                 f"      python: {tok.decode(got)!r}\n      c++:    {tok.decode(cpp)!r}")
            elif cpp != got:
                found.append("C++ runner vs Python runtime (same program, same kernels): tokens differ\n"
                             f"      python: {tok.decode(got)!r}\n"
                             f"      c++:    {tok.decode(cpp)!r}")
        if found:
            problems.append({"prompt": text, "problems": found, "reference_text": entry["reference_text"],
                             "pte_text": entry["pte_text"]})
        prompts.append(entry)
    return prompts, problems


def summarize(prompts: list, quantized: bool) -> dict:
    """Each reference's figures over all prompts (greedy totals, worst logit error, mean top-1 and KLD)."""
    out = {
        key: {
            "greedy_match": sum(p[key]["greedy_match"] for p in prompts),
            "greedy_total": sum(len(p["reference" if key == "same_quant" else "float_reference"]) for p in prompts),
            **teacher_forced_summary(prompts, key),
        } for key in ("same_quant", "vs_float") + (("quant_cost",) if quantized else ())
    }
    if all("floor" in p for p in prompts):  # teacher-forced only: the floor generates nothing
        out["floor"] = teacher_forced_summary(prompts, "floor")
    return out


def teacher_forced_summary(prompts: list, key: str) -> dict:
    return {"max_logit_err": max(p[key]["max_logit_err"] for p in prompts),
            "top1": sum(p[key]["top1"] for p in prompts) / len(prompts),
            "kld": sum(p[key]["kld"] for p in prompts) / len(prompts)}


def pooled_problems(summary: dict, gate) -> list[dict]:
    """The thresholds a gate holds over all prompts (per_prompt: false) instead of prompt by prompt."""
    problems = []
    for key, label in (("same_quant", "vs same-quant reference"), ("vs_float", "vs float eager")):
        th = gate[key]
        if th.per_prompt:
            continue
        s = summary[key]
        found = check(s, th, s["greedy_total"], f"{label} (all prompts)")
        if found:
            problems.append({"prompt": "(all prompts)", "problems": found, "reference_text": "", "pte_text": ""})
    return problems


def floor_problems(summary: dict, th) -> list[dict]:
    """The dynamic gate's relative check: the program may sit a few times the build's numerics floor from its
    reference, no further (1e-4: the floor of a build with nothing to round is ~0)."""
    if th.max_kld_over_floor is None or "floor" not in summary:
        return []
    got, floor = summary["same_quant"]["kld"], summary["floor"]["kld"]
    limit = th.max_kld_over_floor * floor + 1e-4
    if got <= limit:
        return []
    return [{"prompt": "(all prompts)", "problems": [
        f"vs same-quant reference: mean KLD {got:.4g} > {th.max_kld_over_floor} x the numerics floor {floor:.4g} "
        f"(+1e-4) = {limit:.4g}"], "reference_text": "", "pte_text": ""}]


def summarize_native(prompts: list) -> dict:
    runs = [p["native"] for p in prompts]
    return {
        "token_parity": all(p["native"]["generated_ids"] == p["pte"] for p in prompts),
        # twinned kernels: the worst near-tie where the C++ runner picked another token (None: none differed)
        "near_tie_gap": max((p["native"]["near_tie_gap"] for p in prompts if "near_tie_gap" in p["native"]),
                            default=None),
        "prefill_tok_s": _median([r["prefill_tok_s"] for r in runs]),
        "decode_tok_s": _median([r["decode_tok_s"] for r in runs]),
        "peak_rss_mib": max((r["peak_rss_mib"] or 0) for r in runs),
        "cache_report": runs[0].get("cache_report"),
        "cache_bytes": max((r.get("cache_bytes") or -1) for r in runs),
    }


def corpus_fidelity(ctx, tok, eager_f, pte) -> dict:
    """The program against the float model on the fidelity corpus (pipeline/fidelity.py), chunks of up to 512."""
    from pipeline.fidelity import corpus_chunks, hf_logits, program_logits, score
    n_ctx = min(512, ctx.cfg.export.max_context_len)
    chunks = corpus_chunks(tok, n_ctx, ctx.cfg.verify.fidelity_chunks)
    chunk = ctx.cfg.export.prefill_chunk
    engines = {"program": lambda c, first: program_logits(pte, c, first, chunk)}
    with spinner(f"fidelity on {len(chunks)} corpus chunks", ctx.progress):
        return {"n_ctx": n_ctx, **score(lambda c: hf_logits(eager_f.model, c), engines, chunks)["program"]}


def run(ctx) -> dict:
    from transformers import AutoTokenizer

    vc = ctx.cfg.verify
    tok = AutoTokenizer.from_pretrained(ctx.inputs["download"] / "model")
    # the stop set the program publishes (get_eos_ids), the same one the C++ runner uses
    lowered = json.loads((ctx.inputs["lower"] / "lower.json").read_text())
    eos = set(lowered["constant_methods"][EOS_IDS])
    quantized = json.loads((ctx.inputs["quantize"] / "quantize.json").read_text())
    runtime = RUNTIMES[lowered["program"]["runtime"]]
    try:
        with spinner("load eager references and the program", ctx.progress):
            eager_f = torch.load(ctx.inputs["wrap"] / "module.pt", weights_only=False)
            eager_q = eager_f if quantized["linear"] == quantized["embedding"] == "none" else \
                torch.load(ctx.inputs["quantize"] / "module.pt", weights_only=False)
            if adapter.separate(ctx.cfg):  # the fine-tune, as the program runs it: the branches beside the base
                attach_adapter(eager_f, ctx.cfg)
                if eager_q is not eager_f:
                    attach_adapter(eager_q, ctx.cfg, ctx.inputs["quantize"] / SCALES_FILE)
            storage = cache_policy(ctx).kv_dtype
            if storage is not None and CACHE_MODES[ctx.cfg.cache.mode].RUNTIME_OWNED:
                for module in {eager_f, eager_q}:  # (one module when unquantized) round as the program's cache does
                    module.cache.store_as(storage)
            # the same quantization as the backend computes it (XNNPACK's bf16 group scales, its activation rounding)
            reference = BACKENDS[ctx.cfg.backend.name].reference(eager_q)
            gate = vc[gate_of(ctx.cfg)]
            floor = torch.Generator().manual_seed(123) if gate.same_quant.max_kld_over_floor is not None else None
            pte = open_program(ctx.inputs["lower"], policy=cache_policy(ctx))
        other = cross_check_module(ctx)
        with rows_only():  # eager quantized embeddings gather, then dequantize (the same values, a table less)
            prompts, problems = check_prompts(ctx, tok, pte, reference, eager_f, eos, other, floor)
    except Unsupported as err:
        return unsupported_status(ctx, err)
    summary = summarize(prompts, quantized=reference is not eager_f)
    summary["gate"] = gate_of(ctx.cfg)
    problems += pooled_problems(summary, gate) + floor_problems(summary, gate.same_quant)
    if vc.fidelity_chunks > 0:
        summary["fidelity"] = corpus_fidelity(ctx, tok, eager_f, pte)
    summary["runtime"] = runtime.describe()
    summary["cross_check"] = other[0] if other else None
    if vc.native:
        summary["native"] = summarize_native(prompts)
    if vc.batched:
        summary["batched"] = batched = batched_check(ctx, [p["prompt_ids"] for p in prompts],
                                                     [p["native"]["generated_ids"] for p in prompts])
        if not batched["parity"]:
            problems.append({"prompt": "(all, as concurrent sessions)", "problems": [
                f"llm_batched_runner sessions vs single-session C++ runs: tokens differ for prompts "
                f"{[i for i, ok in enumerate(batched['equal']) if not ok]}"],
                "reference_text": "", "pte_text": ""})
    report = {"prompts": prompts, "summary": summary, "problems": problems, "passed": not problems}
    (ctx.out / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    ctx.info["verify_report"] = report
    if problems:
        lines = []
        for p in problems:
            lines += [f"prompt {p['prompt']!r}:"] + [f"    {x}" for x in p["problems"]]
            lines += [f"    eager: {p['reference_text']!r}", f"    .pte:  {p['pte_text']!r}"]
        raise VerifyFailed("verify gate failed\n" + "\n".join(lines))
    return summary
