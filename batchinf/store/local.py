"""file:// backend. A pin's etag is the hex sha256 of the content; writes are atomic (temp file + os.replace)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from batchinf.digests import sha256_fileobj
from batchinf.errors import InputError, StoreError
from batchinf.store.base import (ObjectPin, Store, as_path, changed_error, missing_error, os_fault, parse_uri,
                                 too_big_error)

TMP_SUFFIX = ".batchinf-tmp"  # in-flight writes; never listed
_digests: dict[tuple[int, int, int, int], str] = {}   # (device, inode, size, mtime_ns) -> sha256, read_range's


@contextlib.contextmanager
def _os_errors(op: str, uri: str, missing_is_input: bool = True) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as exc:
        if not missing_is_input:
            raise StoreError(f"local {op} {uri} failed: {exc}") from exc
        raise missing_error(uri) from None
    except OSError as exc:   # EIO, ENOSPC, ESTALE...: TransientError; EACCES, EROFS...: StoreError
        raise os_fault(f"local {op} {uri}", exc) from exc


def _path(uri: str) -> Path:
    scheme, _, path = parse_uri(uri)
    if scheme != "file":
        raise StoreError(f"LocalStore cannot handle {uri}: only file:// uris or plain paths")
    return Path(os.path.normpath(path))


def _pin(path: Path) -> ObjectPin:
    uri = "file://" + str(path)
    with _os_errors("head", uri):
        if not path.is_file():
            raise missing_error(uri)
        with open(path, "rb") as f:
            return ObjectPin(uri=uri, size=os.fstat(f.fileno()).st_size, etag=sha256_fileobj(f))


def _atomic_write(path: Path, uri: str, write: Callable[[BinaryIO], object], durable: bool = True) -> None:
    """Write via a temp file in the same directory, fsync (unless not `durable`), then os.replace;
    no temp file survives a failure."""
    with _os_errors("write", uri, missing_is_input=False):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
        try:
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


class LocalStore(Store):
    """Objects are regular files; 'prefixes' are directories."""

    def list(self, prefix_uri: str, check: Callable[[str, int], bool] | None = None) -> list[ObjectPin]:
        root = _path(prefix_uri)
        files = [root] if root.is_file() else sorted(
            Path(d) / name
            for d, _, names in os.walk(root)
            for name in names
            if not name.endswith(TMP_SUFFIX)
        )
        if check is not None:               # every name checked (by its size too) before any file is hashed
            with _os_errors("list", prefix_uri):
                files = [p for p in files if check("file://" + str(p), p.stat().st_size)]
        return sorted((_pin(p) for p in files), key=lambda pin: pin.uri)

    def head(self, uri: str, version_id: str | None = None) -> ObjectPin:
        if version_id:
            raise InputError(f"{uri}: local files have no versions; remove version_id for it")
        return _pin(_path(uri))

    @contextlib.contextmanager
    def open_read(self, pin: ObjectPin) -> Iterator[BinaryIO]:
        """Hashes the open file once up front (a later os.replace cannot swap it), then yields it rewound."""
        path = _path(pin.uri)
        try:
            f = open(path, "rb")
        except (FileNotFoundError, IsADirectoryError):
            raise changed_error(pin, None) from None
        except OSError as exc:
            raise os_fault(f"local open {pin.uri}", exc) from exc
        with f:
            with _os_errors("read", pin.uri):
                digest = sha256_fileobj(f)
                f.seek(0)
            if digest != pin.etag:
                raise changed_error(pin, digest)
            yield f

    def read_range(self, pin: ObjectPin, start: int, length: int) -> bytes:
        """Checked against the pin by the content hash, computed once per file state (device, inode,
        size, mtime) in this process: the parts of one object do not each hash all of it."""
        try:
            f = open(_path(pin.uri), "rb")
        except (FileNotFoundError, IsADirectoryError):
            raise changed_error(pin, None) from None
        except OSError as exc:
            raise os_fault(f"local open {pin.uri}", exc) from exc
        with f, _os_errors("read", pin.uri):
            st = os.fstat(f.fileno())
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if key not in _digests:
                _digests[key] = sha256_fileobj(f)
            if _digests[key] != pin.etag:
                raise changed_error(pin, _digests[key])
            return os.pread(f.fileno(), max(0, length), start)

    def get_bytes(self, uri: str, limit: int | None = None) -> bytes:
        with _os_errors("read", uri), open(_path(uri), "rb") as f:
            if limit is None:
                return f.read()
            data = f.read(limit + 1)
            if len(data) > limit:
                raise too_big_error(uri, os.fstat(f.fileno()).st_size, limit)
            return data

    def put_bytes(self, uri: str, data: bytes, durable: bool = True) -> None:
        _atomic_write(_path(uri), uri, lambda f: f.write(data), durable)

    def put_file(self, uri: str, path: str | Path) -> None:
        with _os_errors("read", str(path)), open(as_path(path), "rb") as src:
            _atomic_write(_path(uri), uri, lambda f: shutil.copyfileobj(src, f, 1 << 20))

    def download_file(self, uri: str, path: str | Path) -> None:
        with _os_errors("read", uri), open(_path(uri), "rb") as src:
            _atomic_write(as_path(path), str(path), lambda f: shutil.copyfileobj(src, f, 1 << 20))

    def copy(self, src_uri: str, dst_uri: str) -> None:
        with _os_errors("copy", src_uri), open(_path(src_uri), "rb") as src:
            _atomic_write(_path(dst_uri), dst_uri, lambda f: shutil.copyfileobj(src, f, 1 << 20))

    def delete(self, uri: str) -> None:
        with _os_errors("delete", uri):
            _path(uri).unlink(missing_ok=True)

    def delete_prefix(self, prefix_uri: str) -> None:
        root = _path(prefix_uri)
        with _os_errors("delete", prefix_uri):
            if root.is_dir():
                shutil.rmtree(root)
            else:
                root.unlink(missing_ok=True)

    def exists(self, uri: str) -> bool:
        return _path(uri).is_file()
