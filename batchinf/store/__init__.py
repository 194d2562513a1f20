"""Object stores behind one interface, chosen by uri scheme (file:// or a plain path, s3://)."""

from __future__ import annotations

from batchinf import failpoints
from batchinf.errors import StoreError, TransientError
from batchinf.store.base import SUPPORTED_SCHEMES, ObjectPin, Store, join, normalize_uri, split_uri

__all__ = ["ObjectPin", "Store", "get_store", "join", "normalize_uri", "split_uri"]


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
        return _Faulty(store) if failpoints.active() else store  # type: ignore[return-value]
    supported = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
    raise StoreError(f"unsupported uri scheme {scheme!r} in {uri}: supported are {supported} or a plain local path")
