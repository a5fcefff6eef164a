"""Hugging Face hub access: revisions pinned to commits, allow-patterns, clear offline errors.

Tested without network against a folder laid out as the hub cache (HF_HUB_CACHE) in offline mode.
"""
from __future__ import annotations

import re
from pathlib import Path

from pipeline.errors import PipelineError

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


class HubError(PipelineError):
    exit_code = 2


def _explain(m, e: Exception) -> HubError:
    from huggingface_hub.constants import HF_HUB_CACHE, HF_HUB_OFFLINE
    state = "offline mode (HF_HUB_OFFLINE=1)" if HF_HUB_OFFLINE else "the hub is unreachable"
    return HubError(
        f"model.source='hf' model.repo_id={m.repo_id!r} model.revision={m.revision!r}: {state} and "
        f"that revision is not in the local hub cache ({HF_HUB_CACHE}). Use model.source=local or gguf, "
        f"or run where the hub is reachable. ({type(e).__name__})")


def fetch_config(m) -> Path:
    """config.json of the pinned revision: from the local cache, or a small download."""
    from huggingface_hub import hf_hub_download
    if not m.repo_id:
        raise HubError("model.repo_id=None: source=hf needs a repo id like 'HuggingFaceTB/SmolLM2-135M-Instruct'")
    try:
        return Path(hf_hub_download(m.repo_id, "config.json", revision=m.revision or "main",
                                    etag_timeout=5))
    except Exception as e:  # offline, unreachable, unknown repo or revision
        raise _explain(m, e) from None


def snapshot(m, local_dir: Path) -> tuple[Path, str]:
    """Download the allowed files of the pinned revision; returns (folder, resolved commit sha)."""
    from huggingface_hub import snapshot_download
    try:
        path = Path(snapshot_download(m.repo_id, revision=m.revision or "main",
                                      allow_patterns=list(m.allow_patterns), etag_timeout=5))
    except Exception as e:
        raise _explain(m, e) from None
    commit = path.name  # snapshots/<commit>/
    if not COMMIT_RE.match(commit):
        raise HubError(f"model.revision={m.revision!r}: resolved to {commit!r}, not a commit sha")
    return path, commit
