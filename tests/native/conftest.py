"""Fixtures for the native runner / tokenizer tests (tests/native)."""
from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
for p in (str(HERE), str(REPO)):
    if p not in sys.path:
        sys.path.insert(0, p)


@pytest.fixture(scope="session")
def native_bins():
    """(llm_runner, tokenizer_cli), built with native/build.sh if missing or stale."""
    from pipeline import native

    runner = native.runner_path(build=True)
    return runner, native.TOKENIZER_CLI


def _versions() -> str:
    from importlib.metadata import version

    return ",".join(f"{p}={version(p)}" for p in ("torch", "executorch", "transformers", "torchao"))


@pytest.fixture(scope="session")
def tiny_programs() -> Path:
    """Tiny exported programs + Python-runtime reference tokens (native_tiny_export.py).

    Exporting takes a minute or two, so the result is cached per script content and
    package versions under $LLM_NATIVE_TEST_CACHE (default ~/.cache/llm-pipeline/native-tests).
    """
    script = HERE / "native_tiny_export.py"
    key = hashlib.sha256(script.read_bytes() + _versions().encode()).hexdigest()[:16]
    root = Path(os.environ.get("LLM_NATIVE_TEST_CACHE",
                               Path.home() / ".cache" / "llm-pipeline" / "native-tests"))
    out = root / key
    out.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "reference.json").exists():
            proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True,
                                  text=True, timeout=1800)
            if proc.returncode != 0:
                pytest.fail(f"tiny export failed:\n{proc.stderr[-4000:]}")
    return out


@pytest.fixture(scope="session")
def og_programs(native_bins) -> Path:
    """The tiny offgraph programs (offgraph_tiny_export.py), cached per export-script + op-module content
    and package versions."""
    from importlib.metadata import version
    script = HERE / "offgraph_tiny_export.py"
    from pipeline.store import code
    # the script and every pipeline module it reaches (the op, the wrapper, the attention they share, ...)
    blob = script.read_bytes() + b"".join(code.module_path(m).read_bytes()
                                           for m in code.closure("pipeline.model.cache_modes.offgraph"))
    blob += ",".join(f"{p}={version(p)}" for p in ("torch", "executorch", "transformers")).encode()
    key = "og-" + hashlib.sha256(blob).hexdigest()[:16]
    root = Path(os.environ.get("LLM_NATIVE_TEST_CACHE", Path.home() / ".cache" / "llm-pipeline" / "native-tests"))
    out = root / key
    out.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "done").exists():
            proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True,
                                  timeout=1800)
            if proc.returncode != 0:
                pytest.fail(f"offgraph tiny export failed:\n{proc.stderr[-4000:]}")
    return out


@pytest.fixture(scope="session")
def batched_bins(native_bins):
    """(llm_batched_runner, prefix_cache_test), rebuilt with native/build.sh if older than the sources."""
    from pipeline import native

    bins = (native.BUILD_DIR / "llm_batched_runner", native.BUILD_DIR / "prefix_cache_test")
    sources = [native.NATIVE_DIR / "CMakeLists.txt", *(native.NATIVE_DIR / "src").rglob("*"),
               *(native.NATIVE_DIR / "tests").rglob("*")]  # prefix_cache_test.cpp is in native/tests
    newest = max(f.stat().st_mtime for f in sources if f.is_file())
    if any(not b.exists() or b.stat().st_mtime < newest for b in bins):
        native.build_native(force=True)
        for b in bins:
            b.touch()  # ninja leaves up-to-date outputs alone
    return bins
