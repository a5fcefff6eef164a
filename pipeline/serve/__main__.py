"""python -m pipeline.serve: serve a build over the OpenAI HTTP API.

    python -m pipeline.serve                                 # the default recipe's latest serving build
    python -m pipeline.serve --recipe gemma3_offgraph --port 8080
    python -m pipeline.serve --run outputs/runs/<time>

The engine is the C++ batched engine, which runs off-graph programs (cache.mode=offgraph). A recipe whose own build
keeps its cache in the graph (the default does) is served from its serving form, the same recipe with SERVING's
overrides; without such a build the error gives the command that makes it (--build runs it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from pipeline.serve.templates import TEMPLATES

# the serving form of a recipe: the runtime-owned cache the engine batches over; logits for the rows asked only (the
# decode rows of several sessions share a forward, a prefill chunk computes no vocabulary product but for its last
# row); rows for 64 sessions' decode or a prompt's piece a forward; room for a conversation
SERVING = ("cache=offgraph", "export.logits_mode=selected", "export.prefill_chunk=64", "export.max_context_len=2048")


def batched_engine_runs(run: dict) -> bool:
    """The engine batches sessions over a cache the runtime owns (cache.mode=offgraph)."""
    from pipeline.model.cache_modes import CACHE_MODES
    return CACHE_MODES[run["config"]["cache"]["mode"]].RUNTIME_OWNED


def find_build(args) -> Path:
    """The run manifest to serve."""
    from pipeline.generation.builds import latest_run
    if args.run:
        path = Path(args.run)
        return path / "manifest.json" if path.is_dir() else path
    recipe = args.recipe or "default"
    own = latest_run(recipe, required=False)
    if own is not None and batched_engine_runs(json.loads(own.read_text())):
        return own
    serving = latest_run(recipe, overrides=SERVING, required=False)
    if serving is not None:
        return serving
    argv = [sys.executable, "-m", "pipeline", *([] if recipe == "default" else [f"recipe={recipe}"]), *SERVING]
    if args.build:
        print(f"[serve] building the serving form of recipe {recipe}: {' '.join(argv[1:])}", file=sys.stderr)
        if subprocess.run(argv).returncode != 0:
            raise SystemExit(f"error: the build of recipe {recipe}'s serving form failed (above)")
        return latest_run(recipe, overrides=SERVING)
    raise SystemExit(f"error: no serving build of recipe {recipe}: the server's engine batches off-graph programs; "
                     f"build one with `python -m pipeline {' '.join(argv[3:])}` (or add --build)")


def load_run(manifest: Path) -> dict:
    try:
        run = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --run {manifest}: not a run manifest ({e})") from None
    if run.get("status") != "ok" or not run.get("pte") or not Path(run["pte"]).exists():
        raise SystemExit(f"error: --run {manifest}: not a successful build whose program is still there")
    if not batched_engine_runs(run):
        mode = run["config"]["cache"]["mode"]
        raise SystemExit(f"error: --run {manifest}: its program keeps its cache in the graph (cache.mode={mode}); "
                         f"the server's engine batches off-graph programs: build with {' '.join(SERVING)}")
    return run


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m pipeline.serve", description=__doc__.split("\n")[0])
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--run", help="a run directory or its manifest.json")
    which.add_argument("--recipe", help="the latest serving build of this recipe (default: the default recipe's)")
    ap.add_argument("--build", action="store_true", help="build the recipe's serving form if there is none")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    ap.add_argument("--port", type=int, default=8000, help="port, 0 = any free one (default: %(default)s)")
    ap.add_argument("--model-name", help="the model's id in the API (default: the recipe's model)")
    ap.add_argument("--chat-template", help="a Jinja chat template file, or chatml | gemma | llama3, instead of the "
                    "tokenizer's (default: the tokenizer's, else the built-in one whose turn tokens it holds)")
    ap.add_argument("--sessions", type=int, default=8, help="sessions decoding at once (default: %(default)s)")
    ap.add_argument("--queue", type=int, default=32,
                    help="choices waiting beyond the sessions before a request gets 429 (default: %(default)s)")
    ap.add_argument("--prefix-cache-entries", type=int, default=16,
                    help="prompt snapshots kept for later requests that share their beginning (default: %(default)s)")
    ap.add_argument("--speculate", choices=("off", "ngram"), default="ngram",
                    help="prompt-lookup speculation per request (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="engine threads, 0 = the runtime's default")
    args = ap.parse_args(argv)
    for name in ("sessions", "queue", "prefix_cache_entries", "threads"):
        if getattr(args, name) < (1 if name == "sessions" else 0):
            ap.error(f"--{name.replace('_', '-')} must be >= {1 if name == 'sessions' else 0}")
    if not 0 <= args.port <= 65535:
        ap.error(f"--port must be in [0, 65535], got {args.port}")
    if args.timeout <= 0:
        ap.error("--timeout must be > 0")
    if args.chat_template and args.chat_template not in TEMPLATES and not Path(args.chat_template).is_file():
        ap.error(f"--chat-template {args.chat_template}: no such file, nor one of {', '.join(TEMPLATES)}")
    return args


async def serve(args, run: dict) -> int:
    import uvicorn
    from transformers import AutoTokenizer

    from pipeline.native import BATCHED_RUNNER, runner_path
    from pipeline.serve.app import Server, make_app
    from pipeline.serve.engine import Engine, EngineError, engine_argv
    from pipeline.serve.templates import chat_template

    runner_path()  # builds native/ if its binaries are missing or stale
    tok = AutoTokenizer.from_pretrained(run["model_dir"])
    tok.chat_template, turns, where = chat_template(args.chat_template, tok)
    print(f"[serve] chat template: {where}", file=sys.stderr)
    tokenizer_json = Path(run["model_dir"]) / "tokenizer.json"
    engine = Engine(engine_argv(BATCHED_RUNNER, Path(run["pte"]), tokenizer_json if tokenizer_json.exists() else None,
                                sessions=args.sessions, prefix_entries=args.prefix_cache_entries,
                                speculate=args.speculate == "ngram", threads=args.threads, chat=turns))
    try:
        await engine.start()
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    cfg = run["config"]
    name = args.model_name or cfg["model"].get("name") or cfg["model"].get("id") or run.get("recipe")
    server = Server(engine, tok, name, queue=args.queue, timeout=args.timeout,
                    speculate=args.speculate == "ngram" and engine.info.get("speculate", False))
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        await engine.close()
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(make_app(server), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5)
    web = uvicorn.Server(config)
    # the line a parent waits for (child.READY)
    print(f"[serve] {name} ({run['pte']}) on http://{host}:{port}/v1 ({engine.info['max_decode_sequences']} "
          f"sessions, context {engine.info['max_session_tokens']}, logits {engine.info['logits_mode']})",
          file=sys.stderr, flush=True)
    try:
        await web.serve(sockets=[sock])
    finally:
        await engine.close()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = load_run(find_build(args))
    return asyncio.run(serve(args, run))


if __name__ == "__main__":
    sys.exit(main())
