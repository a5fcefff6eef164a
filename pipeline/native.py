"""The native runner (native/): build it on demand and call it.

    python -m pipeline.native path     # build if missing/stale, print the runner path
    python -m pipeline.native build    # same, always runs the (incremental) build

API for the verify stage:
    runner_path(build=True) -> Path
    run(pte, tokenizer, *, prompt=None, prompt_ids=None, chat="0", ...) -> dict (stats JSON)
    encode(tokenizer, prompt, chat) -> list[int]
"""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

NATIVE_DIR = Path(__file__).resolve().parent.parent / "native"
BUILD_DIR = NATIVE_DIR / "build"
RUNNER = BUILD_DIR / "llm_runner"
TOKENIZER_CLI = BUILD_DIR / "tokenizer_cli"
# llmpipe::update_and_attend.out + the off-graph cache C API, for the Python runtime (ctypes)
KERNELS_LIB = BUILD_DIR / "libllmpipe_kernels.so"
BATCHED_RUNNER = BUILD_DIR / "llm_batched_runner"


class NativeError(RuntimeError):
    """Base class for native runner failures."""


class NativeBuildError(NativeError):
    """native/build.sh failed."""


class NativeRunError(NativeError):
    """The runner exited non-zero (or timed out); .stderr holds its report."""

    def __init__(self, message: str, *, returncode: int | None, stderr: str, cmd: Sequence[str]):
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr
        self.cmd = list(cmd)


def _sources() -> list[Path]:
    files = [NATIVE_DIR / "CMakeLists.txt", NATIVE_DIR / "build.sh"]
    # native/src has a folder per part, and native/tests holds sources the build compiles too
    files += sorted((NATIVE_DIR / "src").rglob("*")) + sorted((NATIVE_DIR / "tests").rglob("*"))
    return [f for f in files if f.is_file()]


def _stale(binary: Path) -> bool:
    if not binary.exists():
        return True
    newest = max((f.stat().st_mtime for f in _sources()), default=0.0)
    return binary.stat().st_mtime < newest


def build_native(force: bool = False) -> Path:
    """Runs native/build.sh (under a lock) unless the binaries are up to date."""
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUILD_DIR / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force or _stale(RUNNER) or _stale(TOKENIZER_CLI) or _stale(KERNELS_LIB):
            env = dict(os.environ, PYTHON=sys.executable)
            proc = subprocess.run(["bash", str(NATIVE_DIR / "build.sh")], capture_output=True,
                                  text=True, env=env)
            if proc.returncode != 0 or not RUNNER.exists():
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
                raise NativeBuildError(f"native build failed (native/build.sh):\n{tail}")
            # ninja does not touch up-to-date outputs: mark them fresh for _stale().
            for binary in (RUNNER, TOKENIZER_CLI, KERNELS_LIB, BATCHED_RUNNER):
                if binary.exists():
                    binary.touch()
    return RUNNER


def runner_path(build: bool = True) -> Path:
    """Path of native/build/llm_runner, building it first if missing or older than its sources."""
    if build and (_stale(RUNNER) or _stale(TOKENIZER_CLI)):
        build_native()
    if not RUNNER.exists():
        raise NativeBuildError(f"{RUNNER} does not exist (run: python -m pipeline.native path)")
    return RUNNER


def kernels_library_path(build: bool = True) -> Path:
    """native/build/libllmpipe_kernels.so (the off-graph kernel + cache C API), built if needed.

    Load it with ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL) before loading an offgraph program's
    `forward` in the ExecuTorch Python runtime (pipeline.runtimes.native_cache.load_native_kernels does that).
    """
    if build and (_stale(RUNNER) or _stale(TOKENIZER_CLI) or _stale(KERNELS_LIB)):
        build_native()
    if not KERNELS_LIB.exists():
        raise NativeBuildError(f"{KERNELS_LIB} does not exist (run: python -m pipeline.native build)")
    return KERNELS_LIB


def tokenizer_cli_path(build: bool = True) -> Path:
    runner_path(build)
    return TOKENIZER_CLI


def _call(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, errors="replace")
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise NativeRunError(f"llm_runner timed out after {timeout} s", returncode=None,
                             stderr=err, cmd=args) from None
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["(no output)"]
        errors = [ln for ln in lines if ln.startswith("error:")]
        raise NativeRunError(f"llm_runner failed (exit {proc.returncode}): {(errors or lines)[-1]}",
                             returncode=proc.returncode, stderr=proc.stderr, cmd=args)
    return proc


def run(pte: str | os.PathLike, tokenizer: str | os.PathLike | None, *,
        prompt: str | None = None, prompt_ids: Iterable[int] | None = None, chat: str = "0",
        max_new_tokens: int = 32, temperature: float = 0.0, extra_args: Sequence[str] = (),
        timeout: float = 900.0) -> dict:
    """Runs one generation and returns the runner's stats JSON.

    Keys include prompt_ids, generated_ids (a final stop token included), text,
    stop_reason, load_ms, ttft_ms, prefill_tok_s, decode_tok_s, sampling_ms,
    rss_after_{load,prefill,decode}_mib, peak_rss_mib, recipe_hash.
    Raises NativeRunError (a RuntimeError) with the runner's stderr on failure.
    """
    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of prompt= or prompt_ids=")
    with tempfile.TemporaryDirectory(prefix="llm_runner_") as tmp:
        stats_path = Path(tmp) / "stats.json"
        args = [str(runner_path()), "--pte", str(pte), "--chat", str(chat),
                "--max-new-tokens", str(int(max_new_tokens)), "--temperature", str(float(temperature)),
                "--stats-json", str(stats_path), "--quiet"]
        if tokenizer is not None:
            args += ["--tokenizer", str(tokenizer)]
        if prompt is not None:
            args += ["--prompt", prompt]
        else:
            args += ["--prompt-ids", ",".join(str(int(i)) for i in prompt_ids)]
        args += list(extra_args)
        proc = _call(args, timeout)
        lines = stats_path.read_text().splitlines() if stats_path.exists() else []
        if not lines:
            raise NativeRunError("llm_runner wrote no stats", returncode=proc.returncode,
                                 stderr=proc.stderr, cmd=args)
        return json.loads(lines[-1])


def run_batched(pte: str | os.PathLike, prompts_ids: Sequence[Iterable[int]], *, max_new_tokens: int = 32,
                extra_args: Sequence[str] = (), timeout: float = 1800.0) -> tuple[list[dict], dict]:
    """Greedy generations of several prompts (token ids) as sessions of llm_batched_runner on one
    off-graph program; returns (one GEN_JSON dict per generation, in prompt order; the ENGINE_JSON dict)."""
    runner_path()
    with tempfile.TemporaryDirectory(prefix="llm_batched_") as tmp:
        stats_path = Path(tmp) / "stats.jsonl"
        # --chat 0: raw ids and the program's EOS ids only, as run() (the program's template would add its turn end)
        args = [str(BATCHED_RUNNER), "--pte", str(pte), "--ids", "--chat", "0", "--max-new-tokens", str(int(max_new_tokens)),
                "--stats-json", str(stats_path), "--quiet", *extra_args]
        args += [",".join(str(int(i)) for i in ids) for ids in prompts_ids]
        proc = _call(args, timeout)
        records = [json.loads(ln) for ln in stats_path.read_text().splitlines() if ln.strip()] \
            if stats_path.exists() else []
    gens = sorted((r for r in records if "generation" in r), key=lambda r: r["generation"])
    engine = next((r for r in records if "forwards" in r), None)
    if engine is None or len(gens) != len(prompts_ids):
        raise NativeRunError("llm_batched_runner wrote no complete report", returncode=proc.returncode,
                             stderr=proc.stderr, cmd=args)
    return gens, engine


def kv_args(policy, batched: bool = False) -> list[str]:
    """The runners' flags for a runtime-owned cache policy (pipeline.runtimes.CachePolicy); llm_batched_runner
    sizes each session instead."""
    from pipeline.abi import DTYPE_NAMES
    args = ["--max-session-tokens" if batched else "--kv-max-capacity", str(policy.capacity),
            "--kv-initial-capacity", str(policy.initial_capacity)]
    if policy.windows is not None:
        args += ["--kv-windows", ",".join(str(w) for w in policy.windows)]
    if policy.kv_dtype is not None:
        args += ["--kv-storage-dtype", DTYPE_NAMES[policy.kv_dtype]]
    return args


def cache_args(manifest: dict) -> list[str]:
    """The runner flags a built program needs, from its run manifest: a runtime-owned cache sized to the context,
    its K/V stored as verify ran it (verify.runtime.kv_storage_dtype)."""
    from pipeline.model.cache_modes import CACHE_MODES
    cfg = manifest["config"]
    if not CACHE_MODES[cfg["cache"]["mode"]].RUNTIME_OWNED:
        return []
    storage = cfg["verify"]["runtime"].get("kv_storage_dtype")
    return ["--kv-max-capacity", str(cfg["export"]["max_context_len"]),
            *(["--kv-storage-dtype", str(storage)] if storage is not None else [])]


def encode(tokenizer: str | os.PathLike, prompt: str, chat: str = "0", *,
           pte: str | os.PathLike | None = None, timeout: float = 120.0) -> list[int]:
    """Prompt ids after the chat template, exactly as the runner would feed them."""
    args = [str(runner_path()), "--tokenizer", str(tokenizer), "--prompt", prompt,
            "--chat", str(chat), "--encode"]
    if pte is not None:
        args += ["--pte", str(pte)]
    out = _call(args, timeout).stdout.strip()
    return [int(x) for x in out.split()] if out else []


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv else "path"
    try:
        if cmd == "path":
            print(runner_path())
        elif cmd == "build":
            print(build_native(force=True))
        elif cmd == "tokenizer-cli":
            print(tokenizer_cli_path())
        else:
            print("usage: python -m pipeline.native [path|build|tokenizer-cli]", file=sys.stderr)
            return 2
    except NativeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
