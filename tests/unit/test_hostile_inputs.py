"""Hostile inputs stay bounded: compressed objects (and decompression bombs), Parquet files with
one enormous row group, huge values. Each becomes a clear error for its record or object, within
a fixed memory cap, and the records around it are read as usual."""

from __future__ import annotations

import base64
import bz2
import gzip
import io
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.config import settings
from batchinf.formats import InputRecord, compression, read_records
from batchinf.formats.record import MAX_LINE_BYTES

LINES = [json.dumps({"id": f"r{i}", "text": f"record number {i}"}) for i in range(50)]
PLAIN = ("\n".join(LINES) + "\n").encode()


def _read(data: bytes, uri: str, fmt: str = "jsonl") -> list[InputRecord]:
    return list(read_records(io.BytesIO(data), fmt, uri, "id", "text"))


@pytest.mark.parametrize(("suffix", "compress"), [
    (".jsonl.gz", gzip.compress), (".jsonl.bz2", bz2.compress),
    (".jsonl.zst", lambda b: pa.compress(b, "zstd", asbytes=True)),
])
def test_compressed_jsonl_reads_like_plain(suffix: str, compress) -> None:  # noqa: ANN001
    if suffix.endswith(".zst"):   # pyarrow's zstd is a raw frame: write a real .zst stream
        out = pa.BufferOutputStream()
        with pa.CompressedOutputStream(out, "zstd") as z:
            z.write(PLAIN)
        data = out.getvalue().to_pybytes()
    else:
        data = compress(PLAIN)
    assert _read(data, "s3://b/in" + suffix) == _read(PLAIN, "s3://b/in.jsonl")
    assert len(_read(data, "s3://b/in" + suffix)) == 50


def test_compression_is_detected_by_magic_bytes_too() -> None:
    assert _read(gzip.compress(PLAIN), "file:///in/part.jsonl") == _read(PLAIN, "file:///in/part.jsonl")


def _bomb(real_lines: int, blank_mib: int) -> bytes:
    """A few real records, then `blank_mib` MiB of spaces: tiny compressed, huge expanded."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [z.compress(("\n".join(LINES[:real_lines]) + "\n").encode())]
    block = b" " * (1 << 20)
    parts += [z.compress(block) for _ in range(blank_mib)]
    parts.append(z.flush())
    return b"".join(parts)


@pytest.fixture
def max_expansion_100(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """BATCHINF_MAX_EXPANSION=100 for one test; settings() is re-read before and after it."""
    monkeypatch.setenv("BATCHINF_MAX_EXPANSION", "100")
    settings.cache_clear()
    yield
    settings.cache_clear()


def test_decompression_bomb_becomes_one_error_for_the_rest_of_the_object(monkeypatch: pytest.MonkeyPatch,
                                                                         max_expansion_100: None) -> None:
    monkeypatch.setattr(compression, "MIN_EXPANSION_BYTES", 1 << 20)
    data = _bomb(5, 64)
    got = _read(data, "s3://b/bomb.jsonl.gz")
    assert [r.record_id for r in got[:5]] == [f"r{i}" for i in range(5)] and all(r.error is None for r in got[:5])
    assert len(got) == 6 and got[5].error == "object_too_large" and got[5].ordinal == 5
    assert "s3://b/bomb.jsonl.gz" in got[5].message and "BATCHINF_MAX_EXPANSION" in got[5].message


def test_truncated_compressed_object_reports_corruption() -> None:
    lines = [json.dumps({"id": f"r{i}", "text": f"record {i} " + os.urandom(8).hex()}) for i in range(40_000)]
    data = gzip.compress(("\n".join(lines) + "\n").encode())
    got = _read(data[: len(data) // 2], "file:///x/in.jsonl.gz")
    assert got[-1].error == "corrupt_object" and "file:///x/in.jsonl.gz" in got[-1].message
    assert [r.record_id for r in got[:-1]] == [f"r{i}" for i in range(len(got) - 1)]
    assert len(got) > 10_000


def test_compressed_parquet_is_refused_with_the_fix() -> None:
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ["a"], "text": ["b"]}), buf)
    (rec,) = _read(gzip.compress(buf.getvalue()), "s3://b/t.parquet.gz", fmt="parquet")
    assert rec.error == "unsupported_compression" and "upload it uncompressed" in rec.message


PEAK_SCRIPT = """
import resource, sys
from batchinf.formats import read_records
path, fmt = sys.argv[1], sys.argv[2]
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = errors = 0
with open(path, "rb") as fh:
    for r in read_records(fh, fmt, path, "id", "text"):
        n += 1
        errors += r.error is not None
print(n, errors, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) >> 10)
"""


def _peak(path: Path, fmt: str) -> tuple[int, int, int]:
    """(records, errors, MiB of peak RSS growth) of reading `path` in a fresh process."""
    r = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path), fmt], capture_output=True,
                       text=True, check=True)
    n, errors, mib = map(int, r.stdout.split())
    return n, errors, mib


def test_enormous_parquet_row_group_is_streamed_within_a_memory_cap(tmp_path: Path) -> None:
    """One row group of ~100 MiB of incompressible text: read page by page, memory grows by far
    less than the row group (reading it whole would need all of it at once)."""
    n = 100_000
    texts = [base64.b64encode(os.urandom(750)).decode() for _ in range(n)]
    path = tmp_path / "one-row-group.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)], "text": texts}), path,
                   row_group_size=n, compression="zstd", use_dictionary=False)
    size_mib = path.stat().st_size >> 20
    assert pq.ParquetFile(path).metadata.num_row_groups == 1 and size_mib >= 70
    records_read, errors, growth = _peak(path, "parquet")
    assert (records_read, errors) == (n, 0)
    assert growth < size_mib * 0.75, f"reading grew memory by {growth} MiB for a {size_mib} MiB row group"


@pytest.mark.slow
def test_bomb_is_bounded_in_memory_without_patched_limits(tmp_path: Path) -> None:
    """400 MiB of spaces in ~0.4 MiB of gzip: reading stops at the expansion limit (256 MiB)
    with one error row, and memory stays near one line buffer (MAX_LINE_BYTES), not the object."""
    path = tmp_path / "bomb.jsonl.gz"
    path.write_bytes(_bomb(3, 400))
    records_read, errors, growth = _peak(path, "jsonl")
    assert (records_read, errors) == (4, 1)       # 3 records, then the rest of the object as one error
    assert growth < 2.5 * (MAX_LINE_BYTES >> 20), f"grew by {growth} MiB"


@pytest.mark.slow
def test_huge_plain_line_is_skipped_within_a_memory_cap(tmp_path: Path) -> None:
    path = tmp_path / "long-line.jsonl"
    with open(path, "wb") as f:
        f.write(PLAIN)
        f.write(b'{"id": "huge", "text": "' + b"y" * (400 << 20) + b'"}\n')
        f.write(PLAIN.replace(b'"r', b'"s'))
    records_read, errors, growth = _peak(path, "jsonl")
    assert (records_read, errors) == (101, 1)
    assert growth < 2.5 * (MAX_LINE_BYTES >> 20), f"grew by {growth} MiB for a 400 MiB line"


def test_expansion_limit_is_read_from_settings_when_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """BATCHINF_MAX_EXPANSION is read per object (settings()), not frozen at import time."""
    monkeypatch.setattr(compression, "MIN_EXPANSION_BYTES", 1 << 20)
    data = _bomb(2, 8)
    for multiple in ("1", "7"):
        monkeypatch.setenv("BATCHINF_MAX_EXPANSION", multiple)
        settings.cache_clear()
        try:
            got = _read(data, "s3://b/bomb.jsonl.gz")
        finally:
            settings.cache_clear()
        assert got[-1].error == "object_too_large" and f"({multiple}x its compressed size" in got[-1].message
