"""What storing K/V in fewer bits costs and buys: per model and K/V storage, the KLD against the float model at depths
512, 1024 and 2048, decode tok/s at those depths, and cache bytes per position; llama.cpp's f16, q8_0 and q4_0 K/V
beside it on the same tokens.

    python bench/kv_quant.py                                # both models (about half an hour cold)
    python bench/kv_quant.py --models smollm2 --texts 1     # one model, one text per held-out domain
    python bench/kv_quant.py --no-llama-cpp --no-speed      # fidelity of our storages only
    python bench/kv_quant.py --storages fp16,int4 --no-llama-cpp   # these rows again, the others' last results kept

How:
- Every row of a model runs one off-graph program (the runtime picks the storage per run: verify.runtime's
  kv_storage_dtype, the runners' --kv-storage-dtype), at max context 2112. Fidelity runs the float weights
  (quantize=none), so a row's KLD is its K/V storage's alone (and the float program's numerics, the fp32 row); speed
  runs the default quantization's weights. The programs calibrate their keys (cache.calibrate_keys, on by default
  off-graph: the cache stores (k - m) * a, attention takes q / a, both measured on the calibration corpus), which
  moves the quantized rows and leaves the float storages as they were.
- Texts: the first --texts chunks of 2112 tokens of each held-out domain (bench/corpus). Each is teacher-forced
  through the program in the Python runtime: prefilled in chunks up to 64 positions before a depth, then those 64 one
  token at a time, as a decode runs. KLD and same top-1 of the 64 next-token distributions against the HF float
  model's (one uncached forward over the text); the depths run in one pass over the text.
- llama.cpp (`pip install -e ".[bench]"`): the model's own GGUF with type_k = type_v = f16, q8_0 or q4_0 (flash
  attention on, which a quantized V needs), the logits of the same positions from one evaluation of the text. Its
  weights are the GGUF's own (gemma3's are Q4_K_M), so compare each row with its f16 row: the `+KLD` column.
- Speed: llm_runner at 2 threads, a prompt of `depth` tokens then 64 decoded (EOS ignored), each storage in a process
  of its own; the median of --rounds rounds that run every storage once, in turn. Depth 400 as well: the issue's
  fp16-against-fp32 measurement was made there.
- Bytes per position: what one position costs over every attention layer (a ring layer's slots cost the same); MB at
  32k: what a session of 32,768 positions holds (a ring layer its window + chunk - 1 slots, a flat layer them all).
Writes outputs/bench/kv_quant.json and prints one Markdown table per model.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from common import ROOT, build, gguf_file, write_results

CTX = 2112                      # the programs' max context: depth 2048 and the 64 decoded after it
DEPTHS = (512, 1024, 2048)      # fidelity: the 64 positions before each
SPEED_DEPTHS = (400, 1024, 2048)
WINDOW = 64                     # positions scored (and tokens decoded) per depth
STORAGES = ("fp32", "fp16", "bf16", "int8", "int4")
LONG = 32768                    # the cache bytes a 32k-position session holds (rings at their slots, flat layers full)
LLAMA_KV = {"f16": 1, "q8_0": 8, "q4_0": 2}  # ggml type ids (type_k / type_v)
MODELS = {
    "smollm2": {"fidelity": ["recipe=smollm2_offgraph"], "speed": ["cache=offgraph"]},
    "gemma3": {"fidelity": ["recipe=gemma3_offgraph"], "speed": ["recipe=gemma3_offgraph_8da4w"]},
}
SIZE = [f"export.max_context_len={CTX}", "export.prefill_chunk=64", "export.logits_mode=last"]


def lower_of(manifest: dict) -> Path:
    return next(Path(s["path"]) for s in manifest["stages"] if s["name"] == "lower")


def program_depth_logits(program, ids: list[int]) -> dict[int, torch.Tensor]:
    """Logits predicting tokens (d - WINDOW, d] for each depth d: chunked prefill, then WINDOW decode steps."""
    out, pos = {}, 0
    with torch.no_grad():
        for d in DEPTHS:
            start = d - WINDOW
            while pos < start:
                n = min(program.chunk, start - pos)
                program(torch.tensor([ids[pos:pos + n]]), torch.arange(pos, pos + n))
                pos += n
            rows = [program(torch.tensor([[ids[p]]]), torch.tensor([p]))[0, -1].float() for p in range(start, d)]
            out[d], pos = torch.stack(rows), d
    return out


def llama_depth_logits(path: Path, kv_type: int, threads: int):
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=CTX, n_batch=512, logits_all=True, n_threads=threads, type_k=kv_type,
                type_v=kv_type, flash_attn=True, verbose=False)

    def run(ids):
        llm.reset()
        llm.eval(ids)
        return {d: torch.from_numpy(llm.scores[d - WINDOW:d].copy()).float() for d in DEPTHS}
    return run


def figures(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float, int]:
    """Summed KLD, same top-1 count and rows of one window."""
    lr, lg = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    kld = (lr.exp() * (lr - lg)).sum(-1).clamp_min(0)
    return float(kld.sum()), int((lr.argmax(-1) == lg.argmax(-1)).sum()), len(kld)


def cache_bytes(program, storage: str, positions: int = 1) -> int:
    """K and V bytes over every attention layer at `storage` (the layers the runtime sizes): one position's, or a
    session's of `positions` (a ring layer holds window + chunk - 1 slots, a flat layer every position)."""
    from pipeline import abi
    from pipeline.model.kv.quant import row_width
    from pipeline.runtimes.base import runtime_cache_plan
    dtype = abi.KV_DTYPES[storage]
    specs, _, chunk, _ = runtime_cache_plan(program.constant, program.program.method_names)
    size = torch.empty(0, dtype=dtype).element_size()
    return sum((min(sp.window + chunk - 1, positions) if sp.window > 0 else positions) * sp.kv_heads
               * (row_width(dtype, sp.head_dim) + row_width(dtype, sp.v_dim)) * size for sp in specs)


def fidelity(model: str, args) -> dict:
    from transformers import AutoTokenizer

    from pipeline.corpus import heldout_chunks
    from pipeline.model.loading import load_hf_model
    from pipeline.runtimes import CachePolicy, open_program
    from pipeline import abi
    m = build([*MODELS[model]["fidelity"], *SIZE])
    hf = load_hf_model(m["model_dir"])
    tok = AutoTokenizer.from_pretrained(m["model_dir"])
    texts = [(dom, c) for dom, cs in heldout_chunks(tok, CTX, args.texts).items() for c in cs]
    engines, rows = {}, {}
    for s in args.storages:
        program = open_program(lower_of(m), policy=CachePolicy(capacity=CTX, kv_dtype=abi.KV_DTYPES[s]))
        engines[f"ours {s}"] = functools.partial(program_depth_logits, program)
        rows[f"ours {s}"] = {"engine": "ours", "storage": s, "bytes_per_position": cache_bytes(program, s),
                             "bytes_32k": cache_bytes(program, s, LONG)}
    if not args.no_llama_cpp:
        path = gguf_file(m)
        for kv, t in LLAMA_KV.items():
            engines[f"llama.cpp {kv}"] = llama_depth_logits(path, t, args.threads)
            rows[f"llama.cpp {kv}"] = {"engine": "llama.cpp", "storage": kv}
    sums = {name: {d: [0.0, 0, 0] for d in DEPTHS} for name in engines}
    t0 = time.perf_counter()
    for i, (dom, ids) in enumerate(texts):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([ids[:DEPTHS[-1] + 1]]), use_cache=False).logits[0].float()
        for name, engine in engines.items():
            got = engine(ids)
            for d in DEPTHS:
                k, same, n = figures(ref[d - WINDOW:d], got[d])
                acc = sums[name][d]
                acc[0], acc[1], acc[2] = acc[0] + k, acc[1] + same, acc[2] + n
        print(f"[{model}] text {i + 1}/{len(texts)} ({dom}) {time.perf_counter() - t0:.0f} s", flush=True)
    for name, row in rows.items():
        row["kld"] = {d: sums[name][d][0] / sums[name][d][2] for d in DEPTHS}
        row["top1"] = {d: sums[name][d][1] / sums[name][d][2] for d in DEPTHS}
    return {"texts": [dom for dom, _ in texts], "rows": rows}


def speed(model: str, args) -> dict:
    from transformers import AutoTokenizer

    from pipeline import native
    from pipeline.corpus import heldout_chunks
    m = build([*MODELS[model]["speed"], *SIZE])
    tok = AutoTokenizer.from_pretrained(m["model_dir"])
    ids = next(iter(heldout_chunks(tok, CTX, 1).values()))[0]
    storages = args.storages
    runs = {s: {d: [] for d in SPEED_DEPTHS} for s in storages}
    for r in range(args.rounds):
        order = storages[r % len(storages):] + storages[:r % len(storages)]
        for d in SPEED_DEPTHS:
            for s in order:
                stats = native.run(m["pte"], None, prompt_ids=ids[:d], max_new_tokens=WINDOW,
                                   extra_args=["--kv-max-capacity", str(CTX), "--kv-storage-dtype", s,
                                               "--ignore-eos", "--threads", str(args.threads)])
                runs[s][d].append(stats["decode_tok_s"])
        print(f"[{model}] speed round {r + 1}/{args.rounds}", flush=True)
    return {s: {d: statistics.median(v) for d, v in per.items()} for s, per in runs.items()}


def _row_order(item) -> tuple:
    """ours first, by STORAGES, then llama.cpp's by LLAMA_KV."""
    r = item[1]
    order = STORAGES if r["engine"] == "ours" else tuple(LLAMA_KV)
    return (r["engine"] != "ours", order.index(r["storage"]) if r["storage"] in order else len(order))


def table(model: str, result: dict) -> str:
    """A model's Markdown table, from its results as outputs/bench/kv_quant.json holds them (depths as strings)."""
    rows = result["fidelity"]["rows"]
    speeds = result.get("speed", {})
    base = {"ours": rows.get("ours fp16"), "llama.cpp": rows.get("llama.cpp f16")}
    head = ["engine", "K/V", "bytes/pos", "MB @32k"] + [f"KLD @{d}" for d in DEPTHS] + [f"+KLD @{d}" for d in DEPTHS] + \
        [f"top-1 @{DEPTHS[-1]}"] + [f"tok/s @{d}" for d in SPEED_DEPTHS]
    lines = [f"### {model} ({len(result['fidelity']['texts'])} texts)", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for name, r in rows.items():
        b = base[r["engine"]]
        cells = [r["engine"], r["storage"], str(r.get("bytes_per_position", "")),
                 f"{r['bytes_32k'] / 1e6:.1f}" if "bytes_32k" in r else ""]
        cells += [f"{r['kld'][str(d)]:.5f}" for d in DEPTHS]
        cells += [f"{r['kld'][str(d)] - b['kld'][str(d)]:+.5f}" if b else "" for d in DEPTHS]
        cells += [f"{100 * r['top1'][str(DEPTHS[-1])]:.1f} %"]
        sp = speeds.get(r["storage"]) if r["engine"] == "ours" else None
        cells += [f"{sp[str(d)]:.1f}" if sp else "" for d in SPEED_DEPTHS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--texts", type=int, default=1, help="chunks of 2112 tokens per held-out domain")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--storages", default=",".join(STORAGES),
                    help="our K/V storages to run; a subset replaces those rows of the last results, keeping the rest")
    args = ap.parse_args()
    args.storages = args.storages.split(",")
    if bad := sorted(set(args.storages) - set(STORAGES)):
        raise SystemExit(f"--storages: {bad} not in {list(STORAGES)}")
    if not args.no_llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            raise SystemExit('llama.cpp rows need llama-cpp-python: pip install -e ".[bench]" (or --no-llama-cpp)')
    torch.set_num_threads(args.threads)
    out = ROOT / "outputs" / "bench" / "kv_quant.json"
    results = json.loads(out.read_text()) if out.exists() else {}  # the other models' last results stay
    for model in args.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"--models: {model!r} is not one of {sorted(MODELS)}")
        last = results.get(model, {}) if args.no_llama_cpp or set(args.storages) != set(STORAGES) else {}
        fid = fidelity(model, args)
        rows = {n: r for n, r in last.get("fidelity", {}).get("rows", {}).items() if n not in fid["rows"]}
        fid["rows"] = dict(sorted({**rows, **fid["rows"]}.items(), key=_row_order))
        results[model] = {"fidelity": fid, "speed": last.get("speed", {})}
        if not args.no_speed:
            results[model]["speed"].update(speed(model, args))
        write_results("kv_quant", results)
    for model, result in results.items():
        print("\n" + table(model, json.loads(json.dumps(result))))


if __name__ == "__main__":
    main()
