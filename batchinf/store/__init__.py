"""Object stores behind one interface, chosen by uri scheme (file:// or a plain path, s3://)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, BinaryIO, Iterator

from batchinf import failpoints
from batchinf.errors import StoreError, TransientError
from batchinf.store.base import RANGED_BUFFER, SUPPORTED_SCHEMES, ObjectPin, Store, join, normalize_uri, parse_uri
from batchinf.store.watch import waiting

__all__ = ["ObjectPin", "Store", "get_store", "join", "normalize_uri", "parse_uri"]


_READS = {"list", "head", "open_read", "read_range", "get_bytes", "download_file", "exists"}
_WRITES = {"put_bytes", "put_file", "copy", "delete", "delete_prefix"}


class _Faulty:
    """With BATCHINF_FAILPOINTS set, every store call passes the `store.get` or `store.put`
    failpoint first; an injected `raise` looks like a transient storage fault."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getattr__(self, name: str):  # noqa: ANN204
        attr = getattr(self._store, name)
        point = "store.get" if name in _READS else "store.put" if name in _WRITES else None
        if point is None:
            return attr

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            try:
                failpoints.hit(point)
            except failpoints.FailpointError as exc:
                raise TransientError(f"injected storage fault at {point}") from exc
            return attr(*args, **kwargs)
        return call


# the verb each call is logged with while it runs long (store/watch.py)
_VERBS = {"list": "LIST", "head": "HEAD", "exists": "HEAD", "open_read": "GET", "read_range": "GET",
          "get_bytes": "GET", "download_file": "GET", "put_bytes": "PUT", "put_file": "PUT", "copy": "COPY",
          "delete": "DELETE", "delete_prefix": "DELETE"}


class _Watched:
    """Every call of the store runs under the storage watchdog (`watch.waiting`): one stuck past
    BATCHINF_STORE_WARN_SECONDS is logged with its job and object. `open_read` is watched while
    it fetches (entering it), `open_ranged` per ranged read."""

    def __init__(self, store: Store, scheme: str) -> None:
        self._store, self._scheme = store, scheme

    @property
    def backend(self) -> Store:
        """The store behind the watchdog (and the failpoints, when set)."""
        return getattr(self._store, "_store", self._store)

    def open_ranged(self, pin: ObjectPin, buffer: int = RANGED_BUFFER) -> contextlib.AbstractContextManager[BinaryIO]:
        return Store.open_ranged(self, pin, buffer)  # type: ignore[arg-type]  # its reads: our read_range

    @contextlib.contextmanager
    def open_read(self, pin: ObjectPin) -> Iterator[BinaryIO]:
        with contextlib.ExitStack() as stack:
            with waiting(self._scheme, "GET", pin.uri):
                f = stack.enter_context(self._store.open_read(pin))
            yield f

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        verb = _VERBS.get(name)
        if verb is None:
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            target = args[0] if args else next(iter(kwargs.values()), "")
            with waiting(self._scheme, verb, getattr(target, "uri", target)):
                return attr(*args, **kwargs)
        return call


def get_store(uri: str) -> Store:
    """The backend for ``uri``'s scheme; StoreError naming the scheme if none handles it."""
    scheme = normalize_uri(uri).split("://", 1)[0]
    store: Store | None = None
    if scheme == "file":
        from batchinf.store.local import LocalStore

        store = LocalStore()
    elif scheme == "s3":
        from batchinf.store.s3 import S3Store  # boto3 is imported only when s3 is used

        store = S3Store()
    if store is not None:
        return _Watched(_Faulty(store) if failpoints.active() else store, scheme)  # type: ignore[arg-type,return-value]
    supported = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
    raise StoreError(f"unsupported uri scheme {scheme!r} in {uri}: supported are {supported} or a plain local path")
