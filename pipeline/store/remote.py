"""A remote content-addressed store behind the local one (`run.store_url`), shared by hosts that have no common
filesystem lock.

The local store is a read-through cache in front of it: a local miss asks the remote; a remote hit is fetched,
checked file by file against its manifest's hashes and published locally; a remote miss is built here and
published remotely. Layout under the URL:

    <stage>/<key>/blobs/<upload>/<file>     an upload's files (an upload id per publishing attempt)
    <stage>/<key>/entry.json                the commit: the stage manifest, the upload id, who built it
    <stage>/<key>/lease.json                a builder's claim, renewed while it builds, ignored once expired
    .quarantine/<stage>-<key>-<when>.json   a damaged entry's commit and why, moved aside

An entry exists only once its entry.json does, and entry.json is created exclusively (backends.create) after every
blob of its upload is in place: a writer killed mid-upload leaves blobs nobody references (gc's), and of two hosts
that built the same entry the second's create fails, its blobs are deleted, and both go on with the first's.
The lease only saves work (a host that finds another's live lease waits for its entry instead of building too);
correctness never depends on it.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

from pipeline.store import Store, integrity
from pipeline.store.backends import open_backend, redacted
from pipeline.store.files import MANIFEST, read_manifest, write_json_atomic

log = logging.getLogger(__name__)

LEASE_TTL_S = 60.0     # a lease not renewed for this long is a dead builder's
POLL_S = 0.5


def host_name() -> str:
    return os.environ.get("PIPELINE_HOST") or socket.gethostname()


class RemoteDamaged(Exception):
    pass


try:  # S3's client errors (no bucket, no access, no connection), as one type the session reports in a line
    from botocore.exceptions import BotoCoreError, ClientError
    RemoteUnreachable = (BotoCoreError, ClientError)
except ImportError:
    RemoteUnreachable = ()


class Lease:
    """A claim on building one entry, renewed by a thread until released."""

    def __init__(self, remote: "Remote", key: str, etag: str, body: bytes):
        self.remote, self.key, self.etag, self.body = remote, key, etag, body
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.remote.lease_ttl / 3):
            etag = self.remote.backend.replace(self.key, self.body, self.etag)
            if etag is None:  # expired and taken over: the entry's commit still decides who wins
                log.warning("lease %s was taken over by another host", self.key)
                return
            self.etag = etag

    def release(self) -> None:
        self._stop.set()
        self._thread.join()
        self.remote.backend.delete(self.key, self.etag)


class Remote:
    def __init__(self, url: str, lease_ttl: float = LEASE_TTL_S):
        self.url, self.public_url = url, redacted(url)
        self.backend = open_backend(url)
        self.lease_ttl = lease_ttl
        self.host = host_name()

    @staticmethod
    def _base(stage: str, key: str) -> str:
        return f"{stage}/{key}"

    def commit(self, stage: str, key: str) -> Optional[dict]:
        raw = self.backend.get(f"{self._base(stage, key)}/entry.json")
        try:
            c = json.loads(raw) if raw is not None else None
        except ValueError:
            c = {"manifest": None}
        return c

    # ---- fetch ---------------------------------------------------------------------------------------------
    def fetch(self, store: Store, stage: str, key: str, c: dict) -> Path:
        """The remote entry's files into a local temp dir, checked against its manifest, then published locally.
        Raises RemoteDamaged (nothing published locally) if they are not what the manifest recorded."""
        m = c.get("manifest") or {}
        if m.get("status") != "ok" or m.get("key") != key or "upload" not in c:
            raise RemoteDamaged(["entry.json is not an ok manifest of this key"])
        tmp = store.new_temp(stage, key)
        try:
            blobs = f"{self._base(stage, key)}/blobs/{c['upload']}"
            for rel in m.get("outputs") or {}:
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    self.backend.get_file(f"{blobs}/{rel}", dest)
                except FileNotFoundError:  # a blob gone is damage, not a crash
                    raise RemoteDamaged([f"{rel}: missing"]) from None
            problems = integrity.problems(tmp, m, None)
            if problems:
                raise RemoteDamaged(problems)
            write_json_atomic(tmp / MANIFEST, {**m, "fetched": {"from": self.public_url, "host": self.host,
                                                                "built_by": c.get("host")}})
        except BaseException:
            store.discard(tmp)
            raise
        return store.publish(tmp, stage, key)

    def quarantine(self, stage: str, key: str, c: Optional[dict], problems: list[str]) -> Optional[str]:
        """Move a damaged remote entry aside (its commit and why under .quarantine/), so every host rebuilds it.
        Returns where it went, or None if another host changed it first."""
        base = self._base(stage, key)
        info = self.backend.info(f"{base}/entry.json")
        if info is None:
            return None
        if not self.backend.delete(f"{base}/entry.json", info.etag):
            return None  # changed meanwhile: whoever changed it judges it
        where = f".quarantine/{stage}-{key}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}.json"
        self.backend.create(where, json.dumps({"stage": stage, "key": key, "problems": problems,
                                               "found_by": self.host, "entry": c}, indent=2).encode())
        log.warning("remote entry %s/%s is damaged (%s): moved aside to %s; rebuilding", stage, key[:12],
                    "; ".join(problems), where)
        return where

    # ---- claim, build, publish -----------------------------------------------------------------------------
    def try_lease(self, stage: str, key: str) -> Optional[Lease]:
        name = f"{self._base(stage, key)}/lease.json"
        body = json.dumps({"host": self.host, "pid": os.getpid(), "token": uuid.uuid4().hex}).encode()
        if self.backend.create(name, body):
            return Lease(self, name, self.backend.info(name).etag, body)
        info = self.backend.info(name)
        if info is not None and info.age_s > self.lease_ttl and self.backend.delete(name, info.etag):
            log.warning("lease %s expired (%.0f s without renewal): taking it over", name, info.age_s)
            return self.try_lease(stage, key)
        return None

    def obtain(self, store: Store, stage: str, key: str, record: dict) -> tuple[Optional[Path], Optional[Lease]]:
        """The entry fetched from the remote (path, None), or a lease to build it here (None, lease). Waits while
        another host holds a live lease on it; the time waited goes into record['remote_wait_s']."""
        waited = 0.0
        try:
            while True:
                c = self.commit(stage, key)
                if c is not None:
                    try:
                        entry = self.fetch(store, stage, key, c)
                        record.update(remote="hit", built_by=c.get("host"))
                        return entry, None
                    except RemoteDamaged as e:
                        record.setdefault("remote_quarantined", []).append(
                            {"problems": e.args[0], "moved_to": self.quarantine(stage, key, c, e.args[0])})
                        continue
                lease = self.try_lease(stage, key)
                if lease is not None:
                    if self.commit(stage, key) is not None:  # published between our look and our lease
                        lease.release()
                        continue
                    return None, lease
                time.sleep(POLL_S)
                waited += POLL_S
        finally:
            if waited:
                record["remote_wait_s"] = round(waited, 1)

    def publish(self, stage: str, key: str, entry: Path) -> bool:
        """Upload a locally built entry and commit it; False if another host's commit came first (ours is then
        deleted: the entry is theirs, and the same by key)."""
        m = read_manifest(entry)
        upload = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:12]}"
        blobs = f"{self._base(stage, key)}/blobs/{upload}"
        for rel in m.get("outputs") or {}:
            self.backend.put_file(entry / rel, f"{blobs}/{rel}")
        body = {"manifest": m, "upload": upload, "host": self.host, "published": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if self.backend.create(f"{self._base(stage, key)}/entry.json", json.dumps(body, indent=2).encode()):
            return True
        for name, _ in list(self.backend.list(f"{blobs}/")):
            self.backend.delete(name)
        return False

