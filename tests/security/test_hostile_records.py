"""Attack replays on input readers: a record whose parsing raises anything (a 5,000-digit number,
an array nested 100,000 deep) is that record's error row; an object that is no data of its format
(binary, Parquet read as JSONL, empty or truncated Parquet, JSONL read as Parquet) is one error row
naming the fix. The records beside them are read as usual."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.formats import InputRecord, read_records

GOOD = [json.dumps({"id": f"r{i}", "text": f"record {i}"}).encode() for i in range(3)]


def _read(data: bytes, uri: str, fmt: str = "jsonl", task: str = "embed") -> list[InputRecord]:
    return list(read_records(io.BytesIO(data), fmt, uri, "id", "text", task=task))


def _parquet(n: int = 5) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(n)], "text": [f"row {i}" for i in range(n)]}), buf)
    return buf.getvalue()


HOSTILE_LINES = [
    (b'{"id": "big", "text": "x", "n": ' + b"9" * 5000 + b"}", "write such a number as a string"),
    (b'{"id": "deep", "text": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b"[" * 100_000, "nested too deeply"),
]


@pytest.mark.parametrize(("line", "why"), HOSTILE_LINES)
def test_a_line_whose_parsing_raises_is_its_own_error_row(line: bytes, why: str) -> None:
    got = _read(b"\n".join([GOOD[0], line, GOOD[1], GOOD[2]]) + b"\n", "file:///in/a.jsonl")
    assert [r.record_id for r in got] == ["r0", None, "r1", "r2"]
    assert [r.ordinal for r in got] == [0, 1, 2, 3]
    assert got[1].error == "malformed_json"
    assert "file:///in/a.jsonl line 2" in got[1].message and why in got[1].message


@pytest.mark.parametrize(("line", "why"), HOSTILE_LINES[:2])
def test_openai_batch_lines_too(line: bytes, why: str) -> None:
    ok = json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/embeddings",
                     "body": {"input": "hello"}}).encode()
    got = _read(ok + b"\n" + line + b"\n" + ok.replace(b"c1", b"c2") + b"\n", "file:///in/b.jsonl",
                "openai-batch")
    assert [r.record_id for r in got] == ["c1", None, "c2"]
    assert got[1].error == "malformed_json" and why in got[1].message


def test_a_deeply_nested_id_breaks_only_its_record() -> None:
    # json.loads accepts ~900 levels; printing such an id in the message must not raise out
    nested = b"[" * 900 + b"]" * 900
    got = _read(GOOD[0] + b'\n{"id": ' + nested + b', "text": "x"}\n' + GOOD[1] + b"\n", "file:///in/a.jsonl")
    assert [r.record_id for r in got] == ["r0", None, "r1"]
    assert got[1].error in ("missing_id", "malformed_json")


def test_parquet_read_as_jsonl_is_one_wrong_format_row() -> None:
    got = _read(_parquet(), "file:///in/data.jsonl")
    assert len(got) == 1 and got[0].ordinal == 0 and got[0].error == "wrong_format"
    assert "looks like Parquet (PAR1 magic)" in got[0].message and "set input.format: parquet" in got[0].message


def test_binary_read_as_jsonl_is_one_wrong_format_row() -> None:
    got = _read(b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(range(256)) * 40, "file:///in/a.out")
    assert len(got) == 1 and got[0].error == "wrong_format"
    assert "NUL bytes" in got[0].message and "file:///in/a.out" in got[0].message


def test_gzipped_binary_is_detected_after_decompression() -> None:
    import gzip

    got = _read(gzip.compress(b"\x00\x01\x02" * 1000), "file:///in/x.jsonl.gz")
    assert [r.error for r in got] == ["wrong_format"]


def test_utf16_jsonl_is_told_to_re_encode() -> None:
    got = _read(b"\n".join(GOOD).decode().encode("utf-16"), "file:///in/w.jsonl")
    assert [r.error for r in got] == ["wrong_format"] and "UTF-16" in got[0].message


@pytest.mark.parametrize(("data", "code", "says"), [
    (b"", "corrupt_object", "is empty (0 bytes)"),
    (_parquet()[:-40], "corrupt_object", "truncated or corrupt Parquet"),
    (_parquet()[:100], "corrupt_object", "truncated or corrupt Parquet"),
    (b"\n".join(GOOD) + b"\n", "wrong_format", "set input.format: jsonl"),
    (b"\x00\x01garbage bytes that are no parquet", "wrong_format", "no PAR1 magic"),
])
def test_objects_that_are_no_parquet_are_one_error_row(data: bytes, code: str, says: str) -> None:
    got = _read(data, "file:///in/part-0.parquet", "parquet")
    assert len(got) == 1 and got[0].ordinal == 0
    assert got[0].error == code and says in got[0].message and "file:///in/part-0.parquet" in got[0].message


def test_a_good_parquet_still_reads_every_row() -> None:
    got = _read(_parquet(7), "file:///in/p.parquet", "parquet")
    assert [r.record_id for r in got] == [f"p{i}" for i in range(7)] and all(r.error is None for r in got)
