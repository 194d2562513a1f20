"""Parquet input: one record per row, its id and content read from two named columns.

The file is streamed page by page (a buffered stream, no pre-buffering), so one enormous row
group is read within a fixed memory cap. A compressed Parquet object (.parquet.gz) is refused
with the fix: Parquet compresses its pages itself. An object that is no Parquet (empty, truncated, JSONL) is one
`corrupt_object` / `wrong_format` row for the whole object; a file that breaks mid-way ends with
one `corrupt_object` row for the rest.
"""

from __future__ import annotations

from typing import BinaryIO, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchinf.formats.compression import codec_of
from batchinf.formats.record import FIELD_KEY, MAX_LINE_BYTES, InputRecord, _check, record_id_of

PARQUET_BATCH_ROWS = 1024


def read_parquet(fh: BinaryIO, uri: str, id_field: str, text_field: str, *,
                 kind: str = "text", row_groups: list[int] | None = None,
                 tally: dict[str, int] | None = None) -> Iterator[InputRecord]:
    """Records of a Parquet object, streamed page by page (a buffered stream, no pre-buffering),
    so a file with one enormous row group is read within a fixed memory cap. With `row_groups`
    (a part of the object, planning/ranges.py), those only, their rows numbered from 0 and counted in
    `tally` (the global planning step shifts them by the rows before)."""
    tally = {} if tally is None else tally
    tally.update(lines=0, records=0)
    for r in _read_parquet(fh, uri, id_field, text_field, kind, row_groups):
        tally["records"] = tally["lines"] = r.ordinal + 1
        yield r


def _read_parquet(fh: BinaryIO, uri: str, id_field: str, text_field: str, kind: str,
                  row_groups: list[int] | None) -> Iterator[InputRecord]:
    if codec_of(fh, uri) is not None:
        yield InputRecord(0, None, None, "unsupported_compression",
                          f"{uri}: a compressed Parquet file cannot be read as a stream; Parquet "
                          "compresses its pages itself, so upload it uncompressed (e.g. with "
                          "compression='zstd' inside the file)")
        return
    try:
        pf = pq.ParquetFile(fh, buffer_size=1 << 20, pre_buffer=False)
        names = pf.schema_arrow.names
    except (pa.ArrowException, OSError) as exc:
        yield _not_parquet(fh, uri, exc)
        return
    if row_groups is None:
        row_groups = list(range(pf.metadata.num_row_groups))
    if kind == "record":      # every column: the task reads the fields it needs
        yield from _records(pf, uri, id_field, row_groups)
        return
    missing = [f for f in (id_field, text_field) if f not in names]
    if missing:
        msg = (f"{uri}: has no column {missing[0]!r} (columns: {', '.join(names)}); "
               f"set input.id_field / {FIELD_KEY[kind]}")
        for i in range(sum(pf.metadata.row_group(g).num_rows for g in row_groups)):
            yield InputRecord(i, None, None, "missing_column", msg)
        return
    ordinal = 0
    batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=row_groups, columns=[id_field, text_field])
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:
            yield InputRecord(ordinal, None, None, "corrupt_object",
                              f"{uri}: cannot read past row {ordinal} ({str(exc)[:300]}); the rest of the "
                              "object was not read. Re-upload it or rewrite it with a Parquet writer")
            return
        if batch is None:
            return
        ids = batch.column(0).to_pylist()
        texts = batch.column(1).to_pylist()
        for rid, text in zip(ids, texts):
            where = f"{uri} row {ordinal}"
            if isinstance(text, str) and len(text) > MAX_LINE_BYTES:
                yield InputRecord(ordinal, record_id_of(rid), None, "record_too_large",
                                  f"{where}: {kind} is longer than {MAX_LINE_BYTES} characters; split "
                                  "the record or shorten it")
            else:
                yield _check(ordinal, rid, text, where, id_field, text_field, kind)
            ordinal += 1


def _records(pf: pq.ParquetFile, uri: str, id_field: str, row_groups: list[int]) -> Iterator[InputRecord]:
    """Whole rows (kind record), the id read from `id_field`."""
    ordinal = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=row_groups):
        for row in batch.to_pylist():
            yield _check(ordinal, row.get(id_field), row, f"{uri} row {ordinal}", id_field, "", "record")
            ordinal += 1


def _not_parquet(fh: BinaryIO, uri: str, exc: Exception) -> InputRecord:
    """The one error row of an object pyarrow cannot open as Parquet: what it is, and the fix."""
    size = fh.seek(0, 2)
    fh.seek(0)
    head = fh.read(16)
    fh.seek(0)
    if size == 0:
        return InputRecord(0, None, None, "corrupt_object",
                           f"{uri}: is empty (0 bytes), not a Parquet file; re-upload it or remove it from the input")
    if head.startswith(b"PAR1"):
        return InputRecord(0, None, None, "corrupt_object",
                           f"{uri}: a truncated or corrupt Parquet file ({size} bytes; {str(exc)[:200]}); "
                           "re-upload it (an interrupted upload or a writer that did not close the file)")
    if head.lstrip()[:1] in (b"{", b"["):
        return InputRecord(0, None, None, "wrong_format",
                           f"{uri}: looks like JSON lines, not Parquet (no PAR1 magic); set input.format: jsonl")
    return InputRecord(0, None, None, "wrong_format",
                       f"{uri}: is not a Parquet file (no PAR1 magic; {str(exc)[:200]}); set input.format to "
                       "the file's format or remove it from the input")
