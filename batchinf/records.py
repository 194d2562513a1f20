"""Reading input records from pinned objects. Bad records become error records, never exceptions.

Every record is identified by (source object, ordinal): the ordinal counts the object's records
(non-blank JSONL lines, Parquet rows) from 0, so coverage can be checked even for records whose
id is missing or duplicated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import pyarrow.parquet as pq


@dataclass(frozen=True, slots=True)
class InputRecord:
    ordinal: int
    record_id: str | None
    text: str | None
    error: str | None = None      # error code when the record is unusable
    message: str | None = None


def _record_id(value: object) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (str, int)):
        s = str(value)
        return s if s else None
    return None


def _check(ordinal: int, rid_raw: object, text: object, where: str, id_field: str,
           text_field: str) -> InputRecord:
    rid = _record_id(rid_raw)
    if rid is None:
        what = "missing" if rid_raw is None else f"not a string or integer ({rid_raw!r:.40})"
        return InputRecord(ordinal, None, None, "missing_id",
                           f"{where}: id field {id_field!r} is {what}; every record needs a unique "
                           f"string or integer id (set input.id_field if it has another name)")
    if text is None:
        return InputRecord(ordinal, rid, None, "missing_text",
                           f"{where}: record {rid!r} has no text field {text_field!r} "
                           f"(set input.text_field if it has another name)")
    if not isinstance(text, str):
        return InputRecord(ordinal, rid, None, "invalid_text",
                           f"{where}: record {rid!r} field {text_field!r} must be a string, "
                           f"got {type(text).__name__}")
    if not text.strip():
        return InputRecord(ordinal, rid, None, "empty_text",
                           f"{where}: record {rid!r} has empty text; nothing to embed")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return InputRecord(ordinal, rid, None, "invalid_utf8",
                           f"{where}: record {rid!r} text is not valid Unicode ({exc.reason} at "
                           f"character {exc.start}); fix the escape sequence in the source")
    return InputRecord(ordinal, rid, text)


MAX_LINE_BYTES = 64 << 20   # a longer JSONL line becomes an error row, read in bounded chunks


def _lines(fh: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """The file's lines; None for a line longer than `limit`, which is skipped chunk by chunk so
    memory stays bounded whatever the line's size."""
    while True:
        line = fh.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := fh.readline(limit)) and not rest.endswith(b"\n"):
                pass
            yield None
            continue
        yield line


def read_jsonl(fh: BinaryIO, uri: str, id_field: str, text_field: str,
               max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[InputRecord]:
    ordinal = 0
    for lineno, raw in enumerate(_lines(fh, max_line_bytes), start=1):
        where = f"{uri} line {lineno}"
        if raw is None:
            yield InputRecord(ordinal, None, None, "line_too_long",
                              f"{where}: longer than {max_line_bytes} bytes; split the record or "
                              "shorten its text")
            ordinal += 1
            continue
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield InputRecord(ordinal, None, None, "invalid_utf8",
                              f"{where}: invalid UTF-8 at byte {exc.start} of the line; "
                              "re-encode the file as UTF-8")
            ordinal += 1
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield InputRecord(ordinal, None, None, "malformed_json",
                              f"{where}: malformed JSON ({exc.msg} at column {exc.colno})")
            ordinal += 1
            continue
        if not isinstance(obj, dict):
            yield InputRecord(ordinal, None, None, "malformed_json",
                              f"{where}: expected a JSON object, got {type(obj).__name__}")
        else:
            yield _check(ordinal, obj.get(id_field), obj.get(text_field), where, id_field, text_field)
        ordinal += 1


def read_parquet(fh: BinaryIO, uri: str, id_field: str, text_field: str) -> Iterator[InputRecord]:
    pf = pq.ParquetFile(fh)
    names = pf.schema_arrow.names
    missing = [f for f in (id_field, text_field) if f not in names]
    if missing:
        msg = (f"{uri}: has no column {missing[0]!r} (columns: {', '.join(names)}); "
               f"set input.id_field / input.text_field")
        for i in range(pf.metadata.num_rows):
            yield InputRecord(i, None, None, "missing_column", msg)
        return
    ordinal = 0
    for batch in pf.iter_batches(batch_size=8192, columns=[id_field, text_field]):
        ids = batch.column(0).to_pylist()
        texts = batch.column(1).to_pylist()
        for rid, text in zip(ids, texts):
            yield _check(ordinal, rid, text, f"{uri} row {ordinal}", id_field, text_field)
            ordinal += 1


def read_records(fh: BinaryIO, fmt: str, uri: str, id_field: str, text_field: str) -> Iterator[InputRecord]:
    if fmt == "jsonl":
        return read_jsonl(fh, uri, id_field, text_field)
    if fmt == "parquet":
        return read_parquet(fh, uri, id_field, text_field)
    raise NotImplementedError(f"input format {fmt!r} is not implemented yet")
