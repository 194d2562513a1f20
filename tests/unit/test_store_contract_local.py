"""The Store contract (tests/helpers/store_contract.py) on local files, and what only the local
backend and the uri helpers promise; the same contract runs on S3 in
tests/integration/test_store_contract_s3.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from batchinf.errors import StoreError
from batchinf.store import get_store, join, normalize_uri, parse_uri
from tests.helpers.store_contract import *  # noqa: F403 -- the contract's tests, collected here


@pytest.fixture
def store_root(local_root: str) -> str:
    return join(local_root, "root")


def test_local_put_bytes_atomic_leaves_no_temp_files(local_root: str) -> None:
    store = get_store(local_root)
    uri = join(local_root, "x", "y.bin")
    for i in range(3):
        store.put_bytes(uri, bytes([i]) * 10)
    directory = Path(parse_uri(uri)[2]).parent
    assert os.listdir(directory) == ["y.bin"]
    with pytest.raises(StoreError):
        store.put_bytes(join(local_root, "x", "y.bin", "under-a-file"), b"z")
    assert os.listdir(directory) == ["y.bin"]


def test_uri_helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert normalize_uri("rel/x.txt") == f"file://{tmp_path}/rel/x.txt"
    assert normalize_uri("/abs/dir/") == "file:///abs/dir/"
    assert normalize_uri("s3://b/k") == "s3://b/k"
    assert parse_uri("s3://b/k/x") == ("s3", "b", "k/x")
    assert parse_uri("s3://b") == ("s3", "b", "")
    assert parse_uri("file:///a/b") == ("file", "", "/a/b")
    assert parse_uri("/a/b") == ("file", "", "/a/b")
    assert join("s3://b/", "/x/", "y") == "s3://b/x/y"
    assert join("s3://b", "x/", "y/") == "s3://b/x/y/"
    assert join("file:///", "a") == "file:///a"
    assert join("/tmp/r", "a") == "file:///tmp/r/a"
    with pytest.raises(StoreError, match="bucket"):
        parse_uri("s3:///k")
    with pytest.raises(StoreError, match="absolute"):
        parse_uri("file://rel/x")


def test_get_store_by_scheme() -> None:
    assert type(get_store("/tmp/x").backend).__name__ == "LocalStore"      # behind the watchdog (store/watch.py)
    assert type(get_store("file:///tmp/x").backend).__name__ == "LocalStore"
    assert type(get_store("s3://b/k").backend).__name__ == "S3Store"
    with pytest.raises(StoreError, match=r"'gs'.*file://, s3://"):
        get_store("gs://bucket/key")
