"""Object stores behind one interface, chosen by uri scheme (file:// or a plain path, s3://)."""

from __future__ import annotations

from batchinf.errors import StoreError
from batchinf.store.base import SUPPORTED_SCHEMES, ObjectPin, Store, join, normalize_uri, split_uri

__all__ = ["ObjectPin", "Store", "get_store", "join", "normalize_uri", "split_uri"]


def get_store(uri: str) -> Store:
    """The backend for ``uri``'s scheme; StoreError naming the scheme if none handles it."""
    scheme = normalize_uri(uri).split("://", 1)[0]
    if scheme == "file":
        from batchinf.store.local import LocalStore

        return LocalStore()
    if scheme == "s3":
        from batchinf.store.s3 import S3Store  # boto3 is imported only when s3 is used

        return S3Store()
    supported = ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
    raise StoreError(f"unsupported uri scheme {scheme!r} in {uri}: supported are {supported} or a plain local path")
