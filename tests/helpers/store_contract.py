"""One contract for every Store backend, defined once: local files (tests/unit/test_store_contract_local.py)
and a real (moto) S3 server with versioning (tests/integration/test_store_contract_s3.py). Each of them
collects these tests with `from tests.helpers.store_contract import *` and provides `store_root`: a
fresh empty root uri on its backend (S3: in a versioned bucket)."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.errors import InputError
from batchinf.store import ObjectPin, Store, get_store, join


@pytest.fixture
def store(store_root: str) -> Store:
    return get_store(store_root)


def test_put_get_exists_head(store: Store, store_root: str) -> None:
    uri = join(store_root, "a", "b.txt")
    assert not store.exists(uri)
    store.put_bytes(uri, b"hello")
    assert store.exists(uri)
    assert store.get_bytes(uri) == b"hello"
    pin = store.head(uri)
    assert (pin.uri, pin.size) == (uri, 5)
    assert pin.etag and '"' not in pin.etag
    assert ObjectPin.from_dict(pin.to_dict()) == pin
    if store_root.startswith("s3://"):
        assert pin.version_id  # versioned bucket
    else:
        assert pin.version_id is None
        assert pin.etag == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"


def test_head_and_get_missing_raise_input_error(store: Store, store_root: str) -> None:
    uri = join(store_root, "nope.bin")
    with pytest.raises(InputError, match="nope.bin"):
        store.head(uri)
    with pytest.raises(InputError, match="nope.bin"):
        store.get_bytes(uri)


def test_list_sorted_skips_markers_and_single_object(store: Store, store_root: str) -> None:
    for name in ["d/2.txt", "d/10.txt", "d/sub/x.txt", "d/1.txt", "dd/other.txt"]:
        store.put_bytes(join(store_root, name), name.encode())
    if store_root.startswith("s3://"):
        store.put_bytes(join(store_root, "d/emptydir/"), b"")  # a directory marker
    pins = store.list(join(store_root, "d"))
    assert [p.uri for p in pins] == [join(store_root, n) for n in ["d/1.txt", "d/10.txt", "d/2.txt", "d/sub/x.txt"]]
    assert [p.size for p in pins] == [7, 8, 7, 11]
    assert store.list(join(store_root, "d") + "/") == pins
    assert pins[0] == store.head(pins[0].uri)
    assert store.list(join(store_root, "d/10.txt")) == [store.head(join(store_root, "d/10.txt"))]
    assert store.list(join(store_root, "missing")) == []


def test_copy_delete_delete_prefix(store: Store, store_root: str) -> None:
    src, dst = join(store_root, "src.bin"), join(store_root, "out", "dst.bin")
    store.put_bytes(src, b"\x00payload")
    store.copy(src, dst)
    assert store.get_bytes(dst) == b"\x00payload"
    store.delete(dst)
    assert not store.exists(dst)
    store.delete(dst)  # missing is fine
    for name in ["p/a", "p/b/c", "p2/keep"]:
        store.put_bytes(join(store_root, name), b"x")
    store.delete_prefix(join(store_root, "p"))
    assert store.list(join(store_root, "p")) == []
    assert store.exists(join(store_root, "p2/keep"))
    store.delete_prefix(join(store_root, "never"))  # missing is fine
    with pytest.raises(InputError, match="nothere"):
        store.copy(join(store_root, "nothere"), dst)


def test_put_file_and_download_file(store: Store, store_root: str, tmp_path: Path) -> None:
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(100_000))
    uri = join(store_root, "up.bin")
    store.put_file(uri, src)
    store.download_file(uri, tmp_path / "deep" / "down.bin")
    assert (tmp_path / "deep" / "down.bin").read_bytes() == src.read_bytes()
    with pytest.raises(InputError, match="absent"):
        store.download_file(join(store_root, "absent"), tmp_path / "x")


def test_open_read_returns_pinned_bytes_seekable(store: Store, store_root: str) -> None:
    uri = join(store_root, "t.parquet")
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": [1, 2, 3]}), sink)
    store.put_bytes(uri, sink.getvalue().to_pybytes())
    with store.open_read(store.head(uri)) as f:
        assert f.seekable()
        assert pq.read_table(f).column("x").to_pylist() == [1, 2, 3]


def test_open_read_after_overwrite(store: Store, store_root: str) -> None:
    uri = join(store_root, "obj.txt")
    store.put_bytes(uri, b"old")
    old = store.head(uri)
    store.put_bytes(uri, b"new!")
    if store_root.startswith("s3://"):  # versioned: the pinned version is still readable
        with store.open_read(old) as f:
            assert f.read() == b"old"
    else:
        with pytest.raises(InputError, match=f"{uri}.*re-submit"):
            with store.open_read(old):
                pass
    with store.open_read(store.head(uri)) as f:
        assert f.read() == b"new!"


def test_open_read_after_delete(store: Store, store_root: str) -> None:
    uri = join(store_root, "gone.txt")
    store.put_bytes(uri, b"data")
    pin = store.head(uri)
    store.delete(uri)
    with pytest.raises(InputError, match="gone.txt"):
        store.head(uri)
    if store_root.startswith("s3://"):  # a delete marker hides the key, not the pinned version
        with store.open_read(pin) as f:
            assert f.read() == b"data"
    else:
        with pytest.raises(InputError, match=f"{uri}.*re-submit"):
            with store.open_read(pin):
                pass


def test_ranged_reads_return_the_pinned_bytes(store: Store, store_root: str) -> None:
    uri = join(store_root, "big.jsonl")
    data = bytes(range(256)) * 40
    store.put_bytes(uri, data)
    pin = store.head(uri)
    assert store.read_range(pin, 0, 10) == data[:10]
    assert store.read_range(pin, 5000, 300) == data[5000:5300]
    assert store.read_range(pin, len(data) - 4, 100) == data[-4:]          # fewer at the end
    assert store.read_range(pin, len(data), 10) == b""
    with store.open_ranged(pin, buffer=1000) as f:                           # seekable, read by ranges
        f.seek(9000)
        assert f.read(500) == data[9000:9500] and f.tell() == 9500
        f.seek(-10, 2)
        assert f.read() == data[-10:]
    store.put_bytes(uri, b"overwritten")
    if store_root.startswith("s3://"):  # versioned: ranged reads still read the pinned version
        assert store.read_range(pin, 100, 20) == data[100:120]
    else:
        with pytest.raises(InputError, match=f"{uri}.*re-submit"):
            store.read_range(pin, 100, 20)


__all__ = ["store", *(name for name in list(globals()) if name.startswith("test_"))]   # in definition order
