"""The native runner (native/): build it on demand and call it.

    python -m pipeline native path     # build if missing/stale, print the runner path
    python -m pipeline native build    # same, always runs the (incremental) build
    python -m pipeline native run [--target aarch64] BINARY ARGS...   # a binary of native/build[-aarch64]/
    python -m pipeline native path|build --target aarch64            # the ARM64 cross-build (native/build-aarch64/)

API for the verify stage:
    runner_path(build=True) -> Path
    run(pte, tokenizer, *, prompt=None, prompt_ids=None, chat="0", ...) -> dict (stats JSON)
    encode(tokenizer, prompt, chat) -> list[int]

The ARM64 cross-build (native/build.sh --target aarch64), run under user-mode QEMU:
    aarch64_build(force=False) -> Path (its llm_runner)
    qemu_command(binary_name, args=()) -> list[str]
    run(..., target="aarch64") -> dict (the aarch64 llm_runner's stats JSON)
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

NATIVE_DIR = Path(__file__).resolve().parent.parent / "native"
BUILD_DIR = NATIVE_DIR / "build"
RUNNER = BUILD_DIR / "llm_runner"
TOKENIZER_CLI = BUILD_DIR / "tokenizer_cli"
# our kernels (every llmpipe:: operator) + the off-graph cache C API: what an app links, and what pipeline.ops.load()
# loads into the Python runtime (ctypes)
KERNELS_LIB = BUILD_DIR / "libllmpipe_ops.so"
# verify's emulation of XNNPACK's 4-bit GEMM (pipeline/backends/xnnpack/numerics.py)
VERIFY_LIB = BUILD_DIR / "libllmpipe_verify.so"
BATCHED_RUNNER = BUILD_DIR / "llm_batched_runner"

# The ARM64 cross-build: every target of native/CMakeLists.txt, run under qemu-aarch64.
AARCH64_BUILD_DIR = NATIVE_DIR / "build-aarch64"
AARCH64_TOOLCHAIN = NATIVE_DIR / "cmake" / "aarch64-linux-gnu.cmake"
AARCH64_BINARIES = ("llm_runner", "llm_batched_runner", "tokenizer_cli", "libllmpipe_ops.so", "attention_test",
                    "prefix_cache_test", "sha256_test", "sampler_test", "speculate_test", "attention_bench", "cores_test",
                    "llama_twins_test")
# Debian's cross glibc + libstdc++ (libc6-arm64-cross): the prefix QEMU maps the guest's /lib onto.
QEMU_PREFIX = "/usr/aarch64-linux-gnu"
# The emulated core, unless QEMU_CPU says otherwise: Neoverse N1 (ARMv8.2 + dotprod, Graviton 2; the Cortex-A76 of
# a Raspberry Pi 5 has its features). Not QEMU's default `max`: its SME makes XNNPACK's 8da4w kernels emit garbage
# under QEMU 7.2 (Debian 12).
QEMU_CPU = "neoverse-n1"


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


def _stale(binary: Path, extra: Sequence[Path] = ()) -> bool:
    if not binary.exists():
        return True
    newest = max((f.stat().st_mtime for f in [*_sources(), *extra]), default=0.0)
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
            for binary in (RUNNER, TOKENIZER_CLI, KERNELS_LIB, VERIFY_LIB, BATCHED_RUNNER):
                if binary.exists():
                    binary.touch()
    return RUNNER


def aarch64_build(force: bool = False) -> Path:
    """Cross-builds every native target for ARM64 into native/build-aarch64/ (native/build.sh --target aarch64,
    under a lock) unless they are up to date; returns the aarch64 llm_runner."""
    AARCH64_BUILD_DIR.mkdir(parents=True, exist_ok=True)
    binaries = [AARCH64_BUILD_DIR / name for name in AARCH64_BINARIES]
    with open(AARCH64_BUILD_DIR / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force or any(_stale(b, [AARCH64_TOOLCHAIN]) for b in binaries):
            env = dict(os.environ, PYTHON=sys.executable)
            proc = subprocess.run(["bash", str(NATIVE_DIR / "build.sh"), "--target", "aarch64"],
                                  capture_output=True, text=True, env=env)
            if proc.returncode != 0 or not all(b.exists() for b in binaries):
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
                raise NativeBuildError(f"aarch64 cross-build failed (native/build.sh --target aarch64):\n{tail}")
            for binary in binaries:  # ninja leaves up-to-date outputs alone: mark them fresh for _stale()
                binary.touch()
    return AARCH64_BUILD_DIR / "llm_runner"


def aarch64_binary(name: str, build: bool = True) -> Path:
    """native/build-aarch64/NAME, cross-building first if it is missing or older than its sources."""
    binary = AARCH64_BUILD_DIR / name
    if build and _stale(binary, [AARCH64_TOOLCHAIN]):
        aarch64_build()
    if not binary.exists():
        raise NativeBuildError(f"{binary} does not exist (run: python -m pipeline native build --target aarch64)")
    return binary


def qemu_command(binary_name: str, args: Iterable[str] = ()) -> list[str]:
    """The command line running native/build-aarch64/BINARY_NAME with ARGS under qemu-aarch64 (not built here).

    The guest's LD_LIBRARY_PATH=/lib is the prefix's glibc: without it ld.so.cache hands the prefix's loader the
    multiarch libc6:arm64 (another build of glibc, installed with libpcre2-dev:arm64), and that mix hangs."""
    if shutil.which("qemu-aarch64") is None:
        raise NativeError("qemu-aarch64 not found: apt-get install qemu-user (setup.sh does)")
    return ["qemu-aarch64", "-L", QEMU_PREFIX, "-cpu", os.environ.get("QEMU_CPU") or QEMU_CPU,
            "-E", "LD_LIBRARY_PATH=/lib", str(AARCH64_BUILD_DIR / binary_name), *map(str, args)]


def runner_path(build: bool = True) -> Path:
    """Path of native/build/llm_runner, building it first if missing or older than its sources."""
    if build and (_stale(RUNNER) or _stale(TOKENIZER_CLI)):
        build_native()
    if not RUNNER.exists():
        raise NativeBuildError(f"{RUNNER} does not exist (run: python -m pipeline native path)")
    return RUNNER


def kernels_library_path(build: bool = True, library: Path = KERNELS_LIB) -> Path:
    """native/build/libllmpipe_ops.so (every kernel of ours + the off-graph cache C API), built if needed; `library`:
    another library of the build (VERIFY_LIB).

    pipeline.ops.load() loads it with ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL) before a program that calls our
    operators loads in the ExecuTorch Python runtime.
    """
    if build and (_stale(RUNNER) or _stale(TOKENIZER_CLI) or _stale(library)):
        build_native()
    if not library.exists():
        raise NativeBuildError(f"{library} does not exist (run: python -m pipeline native build)")
    return library


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
        timeout: float = 900.0, target: str | None = None) -> dict:
    """Runs one generation and returns the runner's stats JSON.

    Keys include prompt_ids, generated_ids (a final stop token included), text,
    stop_reason, load_ms, ttft_ms, prefill_tok_s, decode_tok_s, sampling_ms,
    rss_after_{load,prefill,decode}_mib, peak_rss_mib, recipe_hash.
    target="aarch64": the cross-built runner under qemu-aarch64 (built first if missing or stale).
    Raises NativeRunError (a RuntimeError) with the runner's stderr on failure.
    """
    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of prompt= or prompt_ids=")
    if target not in (None, "aarch64"):
        raise ValueError(f"unknown target {target!r} (None: this machine, or 'aarch64')")
    if target == "aarch64":
        aarch64_binary("llm_runner")
        runner = qemu_command("llm_runner")
    else:
        runner = [str(runner_path())]
    with tempfile.TemporaryDirectory(prefix="llm_runner_") as tmp:
        stats_path = Path(tmp) / "stats.json"
        args = [*runner, "--pte", str(pte), "--chat", str(chat),
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
    from pipeline.abi import KV_DTYPE_NAMES
    args = ["--max-session-tokens" if batched else "--kv-max-capacity", str(policy.capacity),
            "--kv-initial-capacity", str(policy.initial_capacity)]
    if policy.windows is not None:
        args += ["--kv-windows", ",".join(str(w) for w in policy.windows)]
    if policy.kv_dtype is not None:
        args += ["--kv-storage-dtype", KV_DTYPE_NAMES[policy.kv_dtype]]
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
