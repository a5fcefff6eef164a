"""The key of a stage's cache entry: hash(stage, version, config slice, upstream keys, tool versions, the
code it runs). Change any of them and the stage rebuilds; change none and it is a cache hit."""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import platform
import subprocess
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline import paths
from pipeline.config import v
from pipeline.store import code
from pipeline.store.files import stable_hash

TOOLS = ("torch", "executorch", "torchao", "transformers", "tokenizers", "gguf", "huggingface_hub")


def tool_versions() -> dict:
    out = {"python": platform.python_version()}
    for t in TOOLS:
        try:
            out[t] = md.version(t.replace("_", "-"))
        except md.PackageNotFoundError:
            out[t] = None
    return out


def source_rev(stage_module) -> str:
    """Hash of the code a stage runs: its module's import closure in the package, plus the non-Python
    sources it declares (SOURCES: files or folders, e.g. native/src for the C++ runner verify calls)."""
    h = hashlib.sha256()
    files = [code.module_path(m) for m in code.closure(stage_module.__name__)]
    for rel in getattr(stage_module, "SOURCES", ()):
        target = paths.ROOT / rel
        files += sorted(f for f in target.rglob("*") if f.is_file()) if target.is_dir() else [target]
    for f in files:
        h.update(Path(f).relative_to(paths.ROOT).as_posix().encode())
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(paths.ROOT), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def config_slice(cfg: DictConfig, keys) -> dict:
    out = {}
    for k in keys:
        node = OmegaConf.select(cfg, k)
        out[k] = OmegaConf.to_container(node, resolve=True, enum_to_str=True) \
            if isinstance(node, DictConfig) else v(node)
    return out


def lineage(stage_module, cfg: DictConfig, upstream: dict, tools: dict, commit: str | None) -> dict:
    """What an entry was built from (recorded in its manifest); `stage_key` hashes all but the git commit."""
    view = getattr(stage_module, "config_view", None)  # a stage whose output depends on less than its keys' values
    config = view(cfg) if view else config_slice(cfg, stage_module.CONFIG_KEYS)
    return {"config": config, "upstream": upstream, "tools": tools,
            "source_rev": source_rev(stage_module), "git_commit": commit}


def stage_key(stage_module, lin: dict) -> str:
    return stable_hash({
        "stage": stage_module.NAME, "version": stage_module.VERSION, "config": lin["config"],
        "upstream": lin["upstream"], "tools": lin["tools"], "source": lin["source_rev"],
    })[:24]
