"""The object-store contract: pins, the Store interface, and URI helpers.

URIs are raw (no percent-encoding): ``s3://bucket/key with spaces`` and
``file:///abs/path`` name exactly the key / path written after the scheme.
"""

from __future__ import annotations

import abc
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO, ContextManager

from batchinf.errors import InputError, StoreError

SUPPORTED_SCHEMES = ("file", "s3")


@dataclass(frozen=True)
class ObjectPin:
    """What a job pins for every input object, so it reads exactly that version later."""

    uri: str
    size: int
    etag: str  # S3 ETag without quotes; for file:// the hex sha256 of the content
    version_id: str | None = None  # S3 VersionId on versioned buckets, else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ObjectPin:
        return cls(uri=str(d["uri"]), size=int(d["size"]), etag=str(d["etag"]), version_id=d.get("version_id"))


def changed_error(pin: ObjectPin, now: str | None) -> InputError:
    """The error raised when a pinned object no longer reads as pinned (``now`` is the current etag or None)."""
    current = f"now {now}" if now else "now missing"
    return InputError(
        f"input object {pin.uri} changed since the job pinned it (etag {pin.etag}, {current}): "
        "restore the original object or re-submit the job to pin the current version"
    )


def missing_error(uri: str) -> InputError:
    return InputError(f"object {uri} does not exist: check the uri (and that the writer finished)")


def normalize_uri(uri_or_path: str) -> str:
    """Return ``uri_or_path`` as a uri; plain local paths become absolute ``file:///...`` (a trailing '/' is kept)."""
    s = os.fspath(uri_or_path)
    if "://" in s:
        return s
    if not s:
        raise StoreError("empty uri or path")
    absolute = os.path.abspath(os.path.expanduser(s))
    if s.endswith("/") and not absolute.endswith("/"):
        absolute += "/"
    return "file://" + absolute


def split_uri(uri: str) -> tuple[str, str, str]:
    """Split into (scheme, bucket, key): ``s3://b/k`` → ("s3", "b", "k"); ``file:///p`` → ("file", "", "/p")."""
    uri = normalize_uri(uri)
    scheme, rest = uri.split("://", 1)
    if scheme == "file":
        if not rest.startswith("/"):
            raise StoreError(f"file uri {uri} is not absolute: write file:///absolute/path")
        return scheme, "", rest
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise StoreError(f"uri {uri} names no bucket: write {scheme}://bucket/key")
    return scheme, bucket, key


def join(base_uri: str, *parts: str) -> str:
    """Join path parts onto a uri with single slashes; keeps the scheme and a trailing '/' of the last part."""
    scheme, rest = normalize_uri(base_uri).split("://", 1)
    pieces = [rest.rstrip("/")] + [p.strip("/") for p in parts if p.strip("/")]
    joined = f"{scheme}://" + "/".join(pieces)
    if parts and parts[-1].endswith("/") and not joined.endswith("/"):
        joined += "/"
    return joined


def as_path(path: str | Path) -> Path:
    return Path(os.fspath(path))


class Store(abc.ABC):
    """One backend per uri scheme. Every method takes full uris; errors are batchinf errors naming the uri."""

    @abc.abstractmethod
    def list(self, prefix_uri: str) -> list[ObjectPin]:
        """Every object under the prefix (a 'directory'), sorted by uri; a uri naming one object lists just it.
        Directory markers (keys ending in '/') are skipped; a missing prefix lists nothing."""

    @abc.abstractmethod
    def head(self, uri: str, version_id: str | None = None) -> ObjectPin:
        """Pin the current (or the given) version of one object; InputError naming the uri if missing."""

    @abc.abstractmethod
    def open_read(self, pin: ObjectPin) -> ContextManager[BinaryIO]:
        """A seekable binary file holding exactly the pinned version; InputError if it changed or vanished."""

    @abc.abstractmethod
    def get_bytes(self, uri: str) -> bytes:
        """The whole current content of one object; InputError if missing."""

    @abc.abstractmethod
    def put_bytes(self, uri: str, data: bytes) -> None:
        """Write one object in full; readers see the old or the new content, never a partial one."""

    @abc.abstractmethod
    def put_file(self, uri: str, path: str | Path) -> None:
        """Upload a local file as one object (multipart for big files where the backend has it)."""

    @abc.abstractmethod
    def download_file(self, uri: str, path: str | Path) -> None:
        """Download one object to a local path, creating parent directories."""

    @abc.abstractmethod
    def copy(self, src_uri: str, dst_uri: str) -> None:
        """Copy one object within this store (server-side where possible)."""

    @abc.abstractmethod
    def delete(self, uri: str) -> None:
        """Delete one object; a missing object is fine."""

    @abc.abstractmethod
    def delete_prefix(self, prefix_uri: str) -> None:
        """Delete the object named by the uri and everything under it as a directory; missing is fine."""

    def exists(self, uri: str) -> bool:
        """Whether one object exists now."""
        try:
            self.head(uri)
        except InputError:
            return False
        return True
