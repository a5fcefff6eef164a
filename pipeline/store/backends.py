"""Where a remote store keeps its objects: a folder (file://, e.g. NFS) or an S3 bucket (s3://), behind one small
interface whose only strong promise is `create`: an object comes into being whole and once, or not at all.

- file://: the object is written to a temp file beside its name, then hard-linked to it (link fails if the name
  exists, on local disks and on NFS alike), so a reader never sees half an object and two writers never both win.
- s3://: PutObject with `If-None-Match: *` (a 412, or a 409 from racing writers, means another writer won).
  Endpoint and credentials come from the environment as boto3 reads them (AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID,
  AWS_PROFILE, ...): never from a recipe.
Keys are '/'-separated paths under the URL's root. `etag` identifies one version of an object, so a delete or a
replace can be made conditional on nobody having changed it since it was read.
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator, NamedTuple, Optional
from urllib.parse import urlsplit, urlunsplit


class ObjectInfo(NamedTuple):
    etag: str
    age_s: float     # seconds since it was last written, by the store's own clock where it has one
    bytes: int


def redacted(url: str) -> str:
    """The URL as a manifest may record it: no user, password or query (where secrets would travel)."""
    p = urlsplit(url)
    host = p.hostname or ""
    if p.port:
        host += f":{p.port}"
    return urlunsplit((p.scheme, host, p.path, "", ""))


def url_problem(url: str) -> Optional[str]:
    """Why a store URL cannot be used (None if it can), checked before any work."""
    p = urlsplit(url)
    if p.scheme == "file":
        return None if p.path.startswith("/") and not p.netloc else "file:// takes an absolute path: file:///dir"
    if p.scheme == "s3":
        if not p.netloc:
            return "s3:// needs a bucket: s3://bucket/prefix"
        try:
            import boto3  # noqa: F401
        except ImportError:
            return "s3:// needs boto3: pip install boto3"
        return None
    return "allowed: file:///absolute/dir or s3://bucket/prefix"


def open_backend(url: str):
    p = urlsplit(url)
    if p.scheme == "file":
        return FileBackend(Path(p.path))
    if p.scheme == "s3":
        return S3Backend(p.netloc, p.path.strip("/"))
    raise ValueError(f"run.store_url={redacted(url)!r}: the scheme must be file:// or s3://")


class FileBackend:
    def __init__(self, root: Path):
        self.root = root

    def _p(self, key: str) -> Path:
        return self.root / key

    def _etag(self, path: Path) -> str:
        st = path.stat()
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"

    def get(self, key: str) -> Optional[bytes]:
        try:
            return self._p(key).read_bytes()
        except FileNotFoundError:
            return None

    def get_file(self, key: str, dest: Path) -> None:
        shutil.copyfile(self._p(key), dest)

    def put_file(self, src: Path, key: str) -> None:
        """A blob: overwriting is harmless (its name holds an upload id nobody else uses)."""
        dest = self._p(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dest)

    def create(self, key: str, data: bytes) -> bool:
        dest = self._p(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")
        tmp.write_bytes(data)
        try:
            os.link(tmp, dest)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def replace(self, key: str, data: bytes, etag: str) -> Optional[str]:
        """Overwrite an object still at version `etag`; its new etag, or None if it changed meanwhile."""
        dest = self._p(key)
        now = self.info(key)
        if now is None or now.etag != etag:
            return None
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
        return self._etag(dest)

    def info(self, key: str) -> Optional[ObjectInfo]:
        try:
            st = self._p(key).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(self._etag(self._p(key)), time.time() - st.st_mtime, st.st_size)

    def delete(self, key: str, etag: Optional[str] = None) -> bool:
        """Remove an object (only if still at version `etag`, when given); False if it was not there or changed."""
        path = self._p(key)
        try:
            if etag is not None and self._etag(path) != etag:
                return False
            # rename first: a reader holding the name sees the old object or none, never a half-deleted one
            gone = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.gone")
            os.rename(path, gone)
            gone.unlink()
            return True
        except FileNotFoundError:
            return False

    def list(self, prefix: str) -> Iterator[tuple[str, ObjectInfo]]:
        base = self._p(prefix)
        if not base.exists():
            return
        for p in sorted(base.rglob("*")):
            if p.is_file() and not p.name.endswith((".part", ".gone")):
                st = p.stat()
                yield p.relative_to(self.root).as_posix(), ObjectInfo(self._etag(p), time.time() - st.st_mtime,
                                                                      st.st_size)


class S3Backend:
    def __init__(self, bucket: str, prefix: str):
        import logging

        import boto3
        logging.getLogger("botocore").setLevel(logging.WARNING)  # its INFO lines (credentials found) are noise here
        self.bucket, self.prefix = bucket, prefix
        self.s3 = boto3.client("s3")

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    @staticmethod
    def _code(e) -> str:
        return str(e.response.get("Error", {}).get("Code", ""))

    def get(self, key: str) -> Optional[bytes]:
        from botocore.exceptions import ClientError
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self._k(key))["Body"].read()
        except ClientError as e:
            if self._code(e) in ("NoSuchKey", "404"):
                return None
            raise

    def get_file(self, key: str, dest: Path) -> None:
        from botocore.exceptions import ClientError
        try:
            self.s3.download_file(self.bucket, self._k(key), str(dest))
        except ClientError as e:
            if self._code(e) in ("NoSuchKey", "404", "NotFound"):
                raise FileNotFoundError(key) from None
            raise

    def put_file(self, src: Path, key: str) -> None:
        self.s3.upload_file(str(src), self.bucket, self._k(key))

    def create(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError
        try:
            self.s3.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, IfNoneMatch="*")
            return True
        except ClientError as e:
            if self._code(e) in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                return False
            raise

    def replace(self, key: str, data: bytes, etag: str) -> Optional[str]:
        from botocore.exceptions import ClientError
        try:
            return self.s3.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, IfMatch=etag)["ETag"]
        except ClientError as e:
            if self._code(e) in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409",
                                 "404"):
                return None
            raise

    def info(self, key: str) -> Optional[ObjectInfo]:
        from botocore.exceptions import ClientError
        try:
            r = self.s3.head_object(Bucket=self.bucket, Key=self._k(key))
        except ClientError as e:
            if self._code(e) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return ObjectInfo(r["ETag"], self._age(r), r["ContentLength"])

    def _age(self, r: dict) -> float:
        """By the server's clock (its Date header), not this host's: hosts' clocks may disagree."""
        from email.utils import parsedate_to_datetime
        date = r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        now = parsedate_to_datetime(date).timestamp() if date else time.time()
        return now - r["LastModified"].timestamp()

    def delete(self, key: str, etag: Optional[str] = None) -> bool:
        from botocore.exceptions import ClientError
        if self.info(key) is None:
            return False
        try:
            kw = {"IfMatch": etag} if etag is not None else {}
            self.s3.delete_object(Bucket=self.bucket, Key=self._k(key), **kw)
            return True
        except ClientError as e:
            if self._code(e) in ("PreconditionFailed", "412", "NoSuchKey", "404"):
                return False
            raise

    def list(self, prefix: str) -> Iterator[tuple[str, ObjectInfo]]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._k(prefix))
        now = time.time()
        for page in pages:
            for o in page.get("Contents", []):
                key = o["Key"][len(self.prefix) + 1:] if self.prefix else o["Key"]
                yield key, ObjectInfo(o["ETag"], now - o["LastModified"].timestamp(), o["Size"])

