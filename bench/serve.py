"""python -m pipeline.serve under load, beside llama.cpp's own server on the same prompts.

    python bench/serve.py                                   # the default's serving build; llama-server if given
    python bench/serve.py --llama-server PATH --llama-quantize PATH --clients 1,4,8,16

Each load level starts the server afresh and runs C clients at once, each sending --requests streamed chat requests
one after the other (the same prompts for both servers, greedy, `ignore_eos` with --max-tokens, so every request
generates the same number of tokens). Reported per level: aggregate tok/s (completion tokens over the level's wall
time), p50 / p99 request latency and time to first token, and the ratio to one client.

llama.cpp: llama-server and llama-quantize built from the llama.cpp sources vendored in llama-cpp-python's sdist
(docs/serving.md says how), on the model's GGUF requantized to --gguf-type (Q4_K_M, at the default's fidelity:
docs/fidelity.md), with one slot per client (-np C), continuous batching, the same threads.

The multi-turn gain: a conversation of about --history tokens (held-out narrative text, then a reply), then its
second turn; that turn's time to first token with the prefix cache (16 entries) and without (a cold prefill of the
whole history), medians of --turns runs. Writes outputs/bench/serve.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import gguf_file, write_results  # noqa: E402  (bench/ is the script's folder)
from pipeline.serve.child import READY, ChildServer  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain why the sky is blue.",
           "List three uses for a paperclip.", "Describe how a bicycle works.", "Give me a recipe for pancakes.",
           "What causes the seasons on Earth?", "Write a short story about a lost key.",
           "Translate good morning into French and Spanish.", "Summarize the plot of Romeo and Juliet.",
           "How do I sort a list in Python?", "Name five planets and one fact about each.",
           "Why do cats purr?", "What is a prime number?", "Tell me about the Moon.", "How does rain form?"]


def start(argv: list[str], pattern: str = READY) -> ChildServer:
    try:
        return ChildServer(argv, pattern, cwd=ROOT, timeout=300)
    except RuntimeError as e:
        sys.exit(str(e))


def ours(run: Path, sessions: int, prefix: int, threads: int) -> tuple[ChildServer, str]:
    p = start([sys.executable, "-m", "pipeline.serve", "--run", str(run), "--port", "0", "--sessions",
                 str(sessions), "--queue", "64", "--prefix-cache-entries", str(prefix), "--threads", str(threads),
                 "--speculate", "off"])
    return p, p.match.group(1)


def llama(binary: Path, gguf: Path, slots: int, ctx_per_slot: int, threads: int, port: int) -> tuple[ChildServer, str]:
    p = start([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                 "-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads), "--cont-batching",
                 "--jinja", "--no-webui"], r"listening on http://|model loaded")
    url = f"http://127.0.0.1:{port}"
    import httpx2 as httpx
    for _ in range(600):  # the model loads after the port opens
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    p.stop()
    sys.exit("llama-server did not become healthy:\n" + "".join(p.log[-30:]))


async def one_request(http, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage, text = None, None, ""
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text += piece
    return {"latency": time.perf_counter() - t0, "ttft": ttft or 0.0,
            "tokens": (usage or {}).get("completion_tokens", 0), "text": text}


async def load(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    import httpx2 as httpx
    results = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        async def client(c: int):
            for k in range(requests):
                prompt = PROMPTS[(c * requests + k) % len(PROMPTS)]
                results.append(await one_request(http, url, model, [{"role": "user", "content": prompt}],
                                                 max_tokens))
        await one_request(http, url, model, [{"role": "user", "content": "Hello."}], 4)  # warm
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    lat = sorted(r["latency"] for r in results)
    ttft = sorted(r["ttft"] for r in results)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 3),
            "tok_s": round(tokens / wall, 1), "p50_latency_s": round(pct(lat, 0.5), 3),
            "p99_latency_s": round(pct(lat, 0.99), 3), "p50_ttft_ms": round(pct(ttft, 0.5) * 1e3, 1),
            "p99_ttft_ms": round(pct(ttft, 0.99) * 1e3, 1)}


def history_text(n_tokens: int, tok) -> str:
    text = (ROOT / "bench" / "corpus" / "heldout" / "narrative.txt").read_text()
    ids = tok(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return tok.decode(ids)


async def second_turn_ttft(url: str, model: str, history: str, turns: int) -> list[float]:
    """Time to first token of a conversation's second turn (the first turn's reply resent), `turns` times with a
    fresh conversation each (a different first question, so that no earlier run's snapshot covers it)."""
    import httpx2 as httpx
    out = []
    async with httpx.AsyncClient(timeout=600) as http:
        for k in range(turns):
            msgs = [{"role": "user", "content": f"Question {k}: read this and be ready to answer.\n\n{history}"}]
            first = await one_request(http, url, model, msgs, 24)
            msgs += [{"role": "assistant", "content": first["text"]},
                     {"role": "user", "content": "Now say in one line what it was about."}]
            out.append((await one_request(http, url, model, msgs, 8))["ttft"])
    return out


def table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'clients':>7} {'tok/s':>8} {'x one':>6} {'p50 lat s':>9} {'p99 lat s':>9} {'p50 ttft ms':>11} "
          f"{'p99 ttft ms':>11}")
    one = rows[0]["tok_s"]
    for r in rows:
        print(f"{r['clients']:>7} {r['tok_s']:>8.1f} {r['tok_s'] / one:>6.2f} {r['p50_latency_s']:>9.3f} "
              f"{r['p99_latency_s']:>9.3f} {r['p50_ttft_ms']:>11.1f} {r['p99_ttft_ms']:>11.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help="the serving build's run directory (default: the default recipe's latest)")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--history", type=int, default=1024, help="tokens of history for the multi-turn gain")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--llama-server", type=Path, help="llama-server built from the vendored llama.cpp")
    ap.add_argument("--llama-quantize", type=Path, help="llama-quantize of the same build")
    ap.add_argument("--gguf-type", default="Q4_K_M")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from pipeline.serve.__main__ import find_build, load_run
    ns = argparse.Namespace(run=args.run, recipe=None, build=True)
    manifest = find_build(ns)
    run = load_run(manifest)
    levels = [int(c) for c in args.clients.split(",")]
    model = run["config"]["model"]["name"]
    results = {"run": str(manifest.parent), "pte": run["pte"], "max_tokens": args.max_tokens,
               "requests_per_client": args.requests, "threads": args.threads, "levels": {}}

    rows = []
    for c in levels:
        server, url = ours(manifest, max(levels), 16, args.threads)
        try:
            rows.append(asyncio.run(load(url, model, c, args.requests, args.max_tokens)))
        finally:
            server.stop()
    results["levels"]["ours"] = rows
    table(rows, f"ours: {run['pte']}")

    if args.llama_server:
        gguf = gguf_file(run)
        q = ROOT / "outputs" / "bench" / "gguf" / f"{gguf.stem}-{args.gguf_type.lower()}.gguf"
        if not q.exists():
            q.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([str(args.llama_quantize), "--allow-requantize", str(gguf), str(q), args.gguf_type],
                           check=True, capture_output=True)
        rows = []
        for c in levels:
            server, url = llama(args.llama_server, q, c, 512 + args.max_tokens, args.threads, 18080)
            try:
                rows.append(asyncio.run(load(url, model, c, args.requests, args.max_tokens)))
            finally:
                server.stop()
        results["levels"]["llama.cpp"] = rows
        results["llama_gguf"] = str(q)
        table(rows, f"llama.cpp server: {q.name}")
        ratio = {r["clients"]: round(a["tok_s"] / r["tok_s"], 2)
                 for a, r in zip(results["levels"]["ours"], rows)}
        results["ours_over_llama"] = ratio
        print("\nours / llama.cpp aggregate tok/s: " + ", ".join(f"{c} clients {x}x" for c, x in ratio.items()))

    from transformers import AutoTokenizer
    history = history_text(args.history, AutoTokenizer.from_pretrained(run["model_dir"]))
    turn = {}
    for label, prefix in (("prefix_cache", 16), ("cold", 0)):
        server, url = ours(manifest, 4, prefix, args.threads)
        try:
            turn[label] = statistics.median(asyncio.run(second_turn_ttft(url, model, history, args.turns)))
        finally:
            server.stop()
    results["second_turn_ttft_ms"] = {k: round(v * 1e3, 1) for k, v in turn.items()}
    results["second_turn_ratio"] = round(turn["prefix_cache"] / turn["cold"], 3)
    print(f"\nsecond turn after ~{args.history} tokens of history: time to first token "
          f"{turn['prefix_cache'] * 1e3:.1f} ms with the prefix cache, {turn['cold'] * 1e3:.1f} ms cold "
          f"({results['second_turn_ratio']:.2f}x)")
    write_results("serve", results)


if __name__ == "__main__":
    main()
