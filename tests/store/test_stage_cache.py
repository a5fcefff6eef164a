"""The content-addressed stage cache: hits, partial rebuilds, manifests, and crash safety."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.paths import ROOT
from pipeline.store import Store
from pipeline.store.files import read_manifest, sha256_file
from tests.helpers import build

TINY = "tiny_llama_xnnpack"


def test_rerun_is_all_hits_and_manifests_have_lineage():
    first = build(TINY)
    again = build(TINY)
    assert [s["cache"] for s in again["stages"]] == ["hit"] * 7
    assert [s["key"] for s in again["stages"]] == [s["key"] for s in first["stages"]]
    for key in ("recipe", "pte", "tokenizer", "model_dir", "stages"):
        assert key in again
    assert again["pte_sha256"] == sha256_file(Path(again["pte"]))  # what `llm_runner --verify-pte` checks
    run_manifest = json.loads(Path(again["run_manifest"]).read_text())
    assert run_manifest["status"] == "ok" and run_manifest["tools"]["executorch"] == "1.5.1"
    for s in run_manifest["stages"]:
        m = read_manifest(Path(s["path"]))
        assert m["status"] == "ok" and m["key"] == s["key"]
        assert set(m["tools"]) >= {"torch", "executorch", "torchao", "transformers"}
        for name, info in m["inputs"].items():
            assert info["key"] == next(x["key"] for x in run_manifest["stages"] if x["name"] == name)
        for rel, out in m["outputs"].items():
            assert sha256_file(Path(s["path"]) / rel) == out["sha256"]


def test_changing_verify_reruns_only_verify():
    base = build(TINY)
    changed = build(TINY, "verify.max_new_tokens=5")
    cache = {s["name"]: s["cache"] for s in changed["stages"]}
    assert all(cache[n] == "hit" for n in ("download", "wrap", "quantize", "export", "lower"))
    assert changed["stages"][-1]["key"] != base["stages"][-1]["key"]
    assert changed["pte"] == base["pte"]


def test_changing_quant_reuses_download_and_wrap():
    base = build(TINY)
    q = build(TINY, "quantize=8da4w", "verify=quantized", stages=("download", "wrap", "quantize"))
    cache = {s["name"]: s["cache"] for s in q["stages"]}
    # calibrate measures what smoothing and the algorithm need, neither changed here: reused too
    assert cache["download"] == "hit" and cache["wrap"] == "hit" and cache["calibrate"] == "hit"
    keys = {s["name"]: s["key"] for s in base["stages"]}
    assert next(s["key"] for s in q["stages"] if s["name"] == "quantize") != keys["quantize"]


def test_entry_without_ok_manifest_does_not_exist(tmp_path):
    store = Store(tmp_path)
    entry = store.entry("export", "abc")
    entry.mkdir(parents=True)
    (entry / "program.pt2").write_bytes(b"half written")
    assert store.lookup("export", "abc") is None
    (entry / "manifest.json").write_text(json.dumps({"status": "error", "key": "abc"}))
    assert store.lookup("export", "abc") is None
    (entry / "manifest.json").write_text(json.dumps({"status": "ok", "key": "abc"}))
    assert store.lookup("export", "abc") is None  # ok, but it records none of the files it holds
    outputs = {"program.pt2": {"sha256": sha256_file(entry / "program.pt2"), "bytes": 12}}
    (entry / "manifest.json").write_text(json.dumps({"status": "ok", "key": "abc", "outputs": outputs}))
    assert store.lookup("export", "abc") == entry


def _default_sigint() -> None:
    # a shell's background job inherits SIGINT ignored, and Python then never raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_during(sig: int, wait_for: str, tmp_out: str) -> None:
    """Start a build, send `sig` once the stage `wait_for` has started, and wait for it to end."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "pipeline", f"recipe={TINY}", f"run.output_dir={tmp_out}",
                          "run.progress=false"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env, preexec_fn=_default_sigint)
    cache = ROOT / tmp_out / "cache" / wait_for
    deadline = time.time() + 300
    while time.time() < deadline and not any(cache.glob(".tmp-*")):
        time.sleep(0.2)
    assert any(cache.glob(".tmp-*")), "the stage never started"
    p.send_signal(sig)  # at once: the temp dir is there from the stage's start to its commit
    out, _ = p.communicate(timeout=120)
    assert p.returncode != 0, out
    assert f"stage={wait_for} " not in out, "the signal landed after the stage had finished"
    if sig == signal.SIGINT:
        assert "interrupted" in out and "Traceback" not in out, out


def _assert_clean_rebuild(tmp_out: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pipeline", f"recipe={TINY}", f"run.output_dir={tmp_out}",
                        "run.progress=false"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-2].startswith("pte: ") and lines[-1].startswith("manifest: ")
    root = ROOT / tmp_out / "cache"
    assert not list(root.glob("*/.tmp-*")), "a dead builder's temp dir survived the rebuild"
    for entry in root.glob("*/*"):
        if not entry.name.startswith(".") and not entry.parent.name.startswith("."):
            m = read_manifest(entry)
            assert m and m["status"] == "ok", entry


def test_kill_9_during_a_stage_then_rerun(tmp_path):
    out = f"outputs/test-kill9-{os.getpid()}"
    try:
        _kill_during(signal.SIGKILL, "lower", out)
        assert not [e for e in (ROOT / out / "cache" / "lower").iterdir() if not e.name.startswith(".")]
        _assert_clean_rebuild(out)
    finally:
        subprocess.run(["rm", "-rf", str(ROOT / out)])


def test_ctrl_c_during_a_stage_then_rerun():
    out = f"outputs/test-sigint-{os.getpid()}"
    try:
        _kill_during(signal.SIGINT, "lower", out)
        assert not list((ROOT / out / "cache" / "lower").glob(".tmp-*")), "Ctrl-C must discard the temp dir"
        _assert_clean_rebuild(out)
    finally:
        subprocess.run(["rm", "-rf", str(ROOT / out)])


def test_offgraph_stages_run_from_a_cached_wrap():
    """A later process gets the wrapped module from the cache (unpickled, no __init__): export and
    verify must still find the off-graph attention."""
    from tests.helpers import run_cli
    first = run_cli("recipe=tiny_llama_offgraph", "run.until=wrap", "run.progress=false")
    assert first.returncode == 0, first.stdout + first.stderr
    r = run_cli("recipe=tiny_llama_offgraph", "run.progress=false")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    m = json.loads(Path(r.stdout.strip().splitlines()[-1].split(": ", 1)[1]).read_text())
    assert {s["name"]: s["cache"] for s in m["stages"]}["wrap"] == "hit"
    assert m["verify"]["native"]["token_parity"]
