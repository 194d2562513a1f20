"""The object-store contract: pins, the Store interface, and URI helpers.

URIs are raw (no percent-encoding): ``s3://bucket/key with spaces`` and
``file:///abs/path`` name exactly the key / path written after the scheme.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import io
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO, Callable, ContextManager, Iterator

from batchinf.errors import InputError, StoreError, TransientError

SUPPORTED_SCHEMES = ("file", "s3")
RANGED_BUFFER = 8 << 20     # bytes per ranged read of `Store.open_ranged`


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


def too_big_error(uri: str, size: int, limit: int) -> InputError:
    return InputError(f"object {uri} is {size} bytes, over the limit of {limit} bytes for it; "
                      "split it, or ask the operator to raise the limit")


def missing_error(uri: str) -> InputError:
    return InputError(f"object {uri} does not exist: check the uri (and that the writer finished)")


# OSError numbers of a fault that may pass: an I/O error, a full disk or quota, a stale NFS handle,
# a lost or refused connection, a timeout, too many open files. Others (EACCES, EROFS, ENOTDIR...)
# need an operator and stay StoreError.
TRANSIENT_ERRNOS = frozenset(getattr(errno, n) for n in (
    "EIO", "ENOSPC", "EDQUOT", "EAGAIN", "EINTR", "EBUSY", "ENOMEM", "ENOBUFS", "EMFILE", "ENFILE", "ESTALE",
    "ETIMEDOUT", "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "EPIPE", "ENETDOWN", "ENETUNREACH", "ENETRESET",
    "EHOSTDOWN", "EHOSTUNREACH", "EREMOTEIO") if hasattr(errno, n))


def transient_os_error(exc: OSError) -> bool:
    """Whether an OSError is a fault worth retrying (`TRANSIENT_ERRNOS`, a timeout, a lost connection)."""
    return isinstance(exc, (ConnectionError, TimeoutError, InterruptedError, BlockingIOError)) \
        or exc.errno in TRANSIENT_ERRNOS


def os_fault(what: str, exc: OSError) -> TransientError | StoreError:
    """`what` failed with `exc`: TransientError when it may pass (`transient_os_error`), else StoreError."""
    if transient_os_error(exc):
        return TransientError(f"{what} failed (retried with backoff): {exc}")
    return StoreError(f"{what} failed: {exc}")


_HOSTILE_ESCAPES = re.compile(r"%(2e|2f|5c|00)", re.IGNORECASE)


def normalize_uri(uri_or_path: str) -> str:
    """Return ``uri_or_path`` as a canonical uri, the one spelling every comparison uses: plain
    local paths become absolute ``file:///...``; the scheme and an S3 bucket are lower-cased;
    ``//``, ``/./`` and ``..`` are resolved (a ``..`` above the root is refused); a trailing '/'
    is kept. Percent-escapes of '.', '/', '\\' and NUL, and NUL bytes, are refused: they exist
    only to make one prefix look like another."""
    s = os.fspath(uri_or_path)
    if not s:
        raise StoreError("empty uri or path")
    if "\x00" in s or _HOSTILE_ESCAPES.search(s):
        raise StoreError(f"uri {s[:200]!r} contains a NUL byte or a percent-escaped '.', '/' or '\\'; "
                         "write the path plainly")
    if "://" not in s:
        absolute = os.path.abspath(os.path.expanduser(s))
        return "file://" + absolute + ("/" if s.endswith("/") and not absolute.endswith("/") else "")
    scheme, rest = s.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        if not rest.startswith("/"):
            raise StoreError(f"file uri {s} is not absolute: write file:///absolute/path")
        bucket, path = "", rest
    else:
        bucket, _, path = rest.partition("/")
        bucket, path = bucket.lower(), "/" + path
    trailing = path.endswith("/") and path != "/"
    parts: list[str] = []
    for seg in path.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if not parts:
                raise StoreError(f"uri {s} climbs above its root with '..'; write the path without '..'")
            parts.pop()
        else:
            parts.append(seg)
    clean = "/" + "/".join(parts) + ("/" if trailing and parts else "")
    return f"{scheme}://{bucket}{clean}"


def parse_uri(uri: str) -> tuple[str, str, str]:
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
    def list(self, prefix_uri: str, check: Callable[[str, int], bool] | None = None) -> list[ObjectPin]:
        """Every object under the prefix (a 'directory'), sorted by uri; a uri naming one object lists just it.
        Directory markers (keys ending in '/') are skipped; a missing prefix lists nothing. `check(uri,
        size)` runs for every object before any byte of it is read or hashed (a grant check, bounds):
        False leaves the object out; what it raises stops the listing."""

    @abc.abstractmethod
    def head(self, uri: str, version_id: str | None = None) -> ObjectPin:
        """Pin the current (or the given) version of one object; InputError naming the uri if missing."""

    @abc.abstractmethod
    def open_read(self, pin: ObjectPin) -> ContextManager[BinaryIO]:
        """A seekable binary file holding exactly the pinned version; InputError if it changed or vanished."""

    @abc.abstractmethod
    def read_range(self, pin: ObjectPin, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of exactly the pinned version (fewer at its end; one ranged
        GET on S3); InputError if it changed or vanished."""

    @contextlib.contextmanager
    def open_ranged(self, pin: ObjectPin, buffer: int = RANGED_BUFFER) -> Iterator[BinaryIO]:
        """A seekable binary file of the pinned version that reads it by `read_range`, `buffer`
        bytes at a time: a part of a large object is read without fetching the rest."""
        with io.BufferedReader(_Ranged(self, pin), buffer_size=buffer) as f:
            yield f  # type: ignore[misc]

    @abc.abstractmethod
    def get_bytes(self, uri: str, limit: int | None = None) -> bytes:
        """The whole current content of one object; InputError if missing, or (before its content is
        read) if it is larger than `limit` bytes."""

    @abc.abstractmethod
    def put_bytes(self, uri: str, data: bytes, durable: bool = True) -> None:
        """Write one object in full; readers see the old or the new content, never a partial one.
        `durable=False`: a scratch file the job re-creates when it is lost, which a local store
        may leave in the page cache (no fsync; a crash of the machine may lose it, not tear it)."""

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


class _Ranged(io.RawIOBase):
    """The pinned version as a seekable raw file over `Store.read_range`."""

    def __init__(self, store: Store, pin: ObjectPin) -> None:
        self.store, self.pin, self.pos = store, pin, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.pin.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        want = min(len(b), self.pin.size - self.pos)
        if want <= 0:
            return 0
        data = self.store.read_range(self.pin, self.pos, want)
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)
