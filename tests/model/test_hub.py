"""The hf source without network: a folder laid out as the hub cache, in offline mode."""
from __future__ import annotations

import json
from pathlib import Path

import shutil

from pipeline.paths import ROOT
from tests.helpers import build, run_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _fake_hub_cache(tmp_path: Path) -> Path:
    """A tiny model published in the hub cache layout: refs/main -> snapshots/<commit>/."""
    m = build("tiny_llama_xnnpack", stages=("download",))
    repo = tmp_path / "hub" / "models--test-org--tiny-llama"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in Path(m["model_dir"]).iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


def test_hf_source_offline_from_hub_cache_pins_the_commit(tmp_path):
    cache = _fake_hub_cache(tmp_path)
    out = f"outputs/test-hub-{tmp_path.name}"
    r = run_cli("recipe=tiny_llama_xnnpack", "model.source=hf", "model.repo_id=test-org/tiny-llama",
                "model.revision=main", "run.until=download", f"run.output_dir={out}", "run.progress=false",
                env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
    assert r.returncode == 0, r.stdout + r.stderr
    run_manifest = json.loads(Path(r.stdout.strip().splitlines()[-1].split(": ", 1)[1]).read_text())
    stage = json.loads((Path(run_manifest["stages"][0]["path"]) / "manifest.json").read_text())
    assert stage["info"]["commit"] == COMMIT and stage["info"]["requested_revision"] == "main"
    assert (Path(run_manifest["model_dir"]) / "tokenizer.json").exists()
    shutil.rmtree(ROOT / out)


def test_hf_source_unknown_revision_offline_is_clear(tmp_path):
    cache = _fake_hub_cache(tmp_path)
    r = run_cli("recipe=tiny_llama_xnnpack", "model.source=hf", "model.repo_id=test-org/tiny-llama",
                "model.revision=" + "f" * 40, "run.until=download",
                env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out, out
    assert "model.repo_id" in out and "not in the local hub cache" in out
