"""run.store_url: a remote store behind the local one, on a real S3-compatible server (moto's standalone server, a
process of its own on a loopback port, started and stopped here) through boto3 over HTTP, and on file://. Each
"host" is a build process of its own with its own local store (outputs/tests/remote-<id>/<host>): they share nothing
but the remote."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from pipeline.paths import ROOT
from pipeline.store.backends import FileBackend, redacted
from pipeline.store.files import read_manifest, sha256_file
from tests.helpers import run_cli, run_manifest

TINY = "tiny_llama_xnnpack"
SECRET = "not-a-real-secret-7f3a"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on 127.0.0.1 for this module; yields the environment a host process needs."""
    port = _free_port()
    # one request at a time: moto checks a conditional put (If-None-Match) and then writes, so its threaded server
    # can let two hosts create the same lease.json at once, where S3 lets one; serialized, it holds as S3 does
    serve = ("from werkzeug.serving import run_simple; "
             "from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app; "
             f"run_simple('127.0.0.1', {port}, DomainDispatcherApplication(create_backend_app), threaded=False)")
    proc = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    env = {"AWS_ENDPOINT_URL_S3": url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, val in old.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def bucket(s3):
    import boto3
    name = f"store-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def _client():
    import boto3
    return boto3.client("s3")


def _keys(bucket: str) -> list[str]:
    pages = _client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [o["Key"] for p in pages for o in p.get("Contents", [])]


def _read_json(bucket: str, key: str) -> dict:
    return json.loads(_client().get_object(Bucket=bucket, Key=key)["Body"].read())


def _commit_of(bucket: str, m: dict, stage: str) -> tuple[str, str, dict]:
    """A built stage's remote entry: its folder, its entry.json's name and content (under the prefix 'ci')."""
    rec = next(s for s in m["stages"] if s["name"] == stage)
    folder = f"ci/{stage}/{rec['key']}"
    return folder, f"{folder}/entry.json", _read_json(bucket, f"{folder}/entry.json")


def _host_args(host_dir: str, url: str, *extra: str) -> list[str]:
    return [f"recipe={TINY}", f"run.output_dir=outputs/tests/{host_dir}", f"run.store_url={url}",
            "run.progress=false", *extra]


def _start(host: str, host_dir: str, url: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline", *_host_args(host_dir, url, *extra)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PIPELINE_HOST": host}, start_new_session=True)


def _manifest_of(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    line = next(ln for ln in reversed(out.splitlines()) if ln.startswith("manifest: "))
    path = Path(line.split(": ", 1)[1])
    return {**json.loads(path.read_text()), "run_manifest": str(path), "stderr": err}


def test_two_hosts_build_each_entry_once_then_a_third_fetches_them(bucket):
    run = uuid.uuid4().hex[:8]
    url = f"s3://{bucket}/ci"
    a, b = _start("host-a", f"remote-{run}/a", url), _start("host-b", f"remote-{run}/b", url)
    ma, mb = _manifest_of(a), _manifest_of(b)
    keys = _keys(bucket)
    commits = [k for k in keys if k.endswith("/entry.json")]
    assert len(commits) == 7 and not [k for k in keys if k.endswith("lease.json")]
    published = [s for m in (ma, mb) for s in m["stages"] if s.get("remote") == "published"]
    assert len(published) == 7  # each entry built and committed once between the two
    lost = [s for m in (ma, mb) for s in m["stages"] if s.get("remote") == "lost the race"]
    assert not lost, lost  # the lease held: no entry was built on both hosts with one upload thrown away
    assert len(ma["stages"]) == len(mb["stages"]) == 7
    for sa, sb in zip(ma["stages"], mb["stages"]):  # built on one host, fetched by the other
        assert sorted([sa["cache"], sb["cache"]]) == ["miss", "remote"], (sa, sb)
    # every upload left is the one its commit names (a lost race's blobs are deleted)
    for c in commits:
        upload = _read_json(bucket, c)["upload"]
        stage_dir = c.rsplit("/", 1)[0]
        assert {k.split("/")[4] for k in keys if k.startswith(f"{stage_dir}/blobs/")} == {upload}, (c, lost)
    for m in (ma, mb):
        assert m["store_url"] == url
        assert SECRET not in Path(m["run_manifest"]).read_text()
    c = _manifest_of(_start("host-c", f"remote-{run}/c", url))
    assert [s["cache"] for s in c["stages"]] == ["remote"] * 7
    assert {s["built_by"] for s in c["stages"]} <= {"host-a", "host-b"}
    for s in c["stages"]:  # published locally only after every file matched the manifest
        m = read_manifest(Path(s["path"]))
        assert all(sha256_file(Path(s["path"]) / rel) == o["sha256"] for rel, o in m["outputs"].items())
    assert c["pte_sha256"] == ma["pte_sha256"]
    again = _manifest_of(_start("host-a", f"remote-{run}/a", url))
    assert [s["cache"] for s in again["stages"]] == ["hit"] * 7


def test_a_damaged_remote_entry_is_moved_aside_rebuilt_and_never_served(bucket):
    run = uuid.uuid4().hex[:8]
    url = f"s3://{bucket}/ci"
    first = _manifest_of(_start("host-a", f"remote-{run}/a", url))
    folder, commit_key, old = _commit_of(bucket, first, "lower")
    _client().put_object(Bucket=bucket, Key=f"{folder}/blobs/{old['upload']}/model.pte", Body=b"not the program")
    m = _manifest_of(_start("host-b", f"remote-{run}/b", url))
    rec = next(s for s in m["stages"] if s["name"] == "lower")
    assert rec["cache"] == "miss" and rec["remote"] == "published"
    assert "model.pte" in rec["remote_quarantined"][0]["problems"][0]
    aside = [k for k in _keys(bucket) if k.startswith("ci/.quarantine/lower-")]
    assert len(aside) == 1
    why = _read_json(bucket, aside[0])
    assert why["entry"]["upload"] == old["upload"] and why["found_by"] == "host-b"
    new = _read_json(bucket, commit_key)
    assert new["upload"] != old["upload"]
    assert sha256_file(Path(m["pte"])) == m["pte_sha256"] == first["pte_sha256"]  # rebuilt, the same bytes


def test_a_builder_killed_mid_stage_leaves_no_entry_and_its_lease_expires(bucket):
    run = uuid.uuid4().hex[:8]
    url = f"s3://{bucket}/ci"
    lease = ("run.store_lease_s=3",)
    a = _start("host-a", f"remote-{run}/a", url, *lease)
    deadline = time.time() + 300
    while time.time() < deadline and not any(k.startswith("ci/lower/") and k.endswith("lease.json")
                                             for k in _keys(bucket)):
        time.sleep(0.2)
    os.killpg(a.pid, signal.SIGKILL)
    a.wait()
    keys = _keys(bucket)
    assert not [k for k in keys if k.startswith("ci/lower/") and k.endswith("entry.json")]
    m = _manifest_of(_start("host-b", f"remote-{run}/b", url, *lease))
    rec = {s["name"]: s for s in m["stages"]}
    assert [rec[n]["cache"] for n in ("download", "wrap", "calibrate", "quantize", "export")] == ["remote"] * 5
    assert rec["lower"]["cache"] == "miss" and rec["lower"]["remote"] == "published"
    # the dead builder's lease, not renewed for 3 s, was taken over (waiting for it when it was younger)
    assert "expired" in m["stderr"] and "taking it over" in m["stderr"]
    assert not [k for k in _keys(bucket) if k.endswith("lease.json")]


def test_gc_on_the_remote_store_applies_the_local_rules(bucket):
    from pipeline.stages import STAGES
    from pipeline.store.remote import Remote
    from pipeline.store.remote_gc import plan
    run = uuid.uuid4().hex[:8]
    url = f"s3://{bucket}/ci"
    m = _manifest_of(_start("host-a", f"remote-{run}/a", url))
    _, commit_key, c = _commit_of(bucket, m, "export")
    c["manifest"]["source_rev"] = "older-code"
    _client().put_object(Bucket=bucket, Key=commit_key, Body=json.dumps(c).encode())
    _client().put_object(Bucket=bucket, Key="ci/wrap/0123abcd/blobs/dead-upload/module.pt", Body=b"half")
    doomed = {(s, why.split(" (")[0]) for s, _, _, why in plan(Remote(url), STAGES, grace_s=0)}
    assert doomed == {("export", "built by other code"), ("lower", "its inputs are removed"),
                      ("verify", "its inputs are removed"), ("wrap", "an upload no entry names")}
    r = subprocess.run([sys.executable, "-m", "pipeline", "gc", "--store-url", url], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    keys = _keys(bucket)
    assert not [k for k in keys if k.startswith(("ci/export/", "ci/lower/", "ci/verify/"))]
    assert len([k for k in keys if k.endswith("entry.json")]) == 4
    assert [k for k in keys if "dead-upload" in k]  # younger than the grace period: a live upload may look so


def test_a_file_store_creates_each_object_once_under_a_race(tmp_path):
    backend = FileBackend(tmp_path)
    wins = []

    def racer(i):
        if backend.create("lower/k/entry.json", f"writer {i}".encode() * 1000):
            wins.append(i)
    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert backend.get("lower/k/entry.json") == f"writer {wins[0]}".encode() * 1000
    assert [p.name for p in (tmp_path / "lower" / "k").iterdir()] == ["entry.json"]


def test_the_store_url_is_checked_before_any_work_and_recorded_without_secrets():
    assert redacted("s3://key:secret@bucket/prefix?token=x") == "s3://bucket/prefix"
    r = run_cli(f"recipe={TINY}", "run.store_url=ftp://example/store")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "run.store_url='ftp://example/store'" in r.stderr and "s3://bucket/prefix" in r.stderr
    assert "stage=" not in r.stdout + r.stderr


def test_an_unreachable_store_is_one_clear_error():
    r = run_cli(f"recipe={TINY}", "run.store_url=s3://no-such-bucket/x", "run.progress=false",
                f"run.output_dir=outputs/tests/remote-{uuid.uuid4().hex[:8]}",  # a local miss asks the store
                env={"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{_free_port()}", "AWS_ACCESS_KEY_ID": "t",
                     "AWS_SECRET_ACCESS_KEY": "t", "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "run.store_url=s3://no-such-bucket/x: cannot read the store" in r.stderr


def test_a_file_store_serves_a_second_local_store(tmp_path):
    run = uuid.uuid4().hex[:8]
    url = f"file://{tmp_path}/shared"
    first = run_manifest(run_cli(*_host_args(f"remote-{run}/a", url)))
    second = run_manifest(run_cli(*_host_args(f"remote-{run}/b", url)))
    assert [s["cache"] for s in second["stages"]] == ["remote"] * 7
    assert second["pte_sha256"] == first["pte_sha256"]
