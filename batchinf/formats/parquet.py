"""Parquet input: one record per row, its id and content read from two named columns.

The file is streamed page by page (a buffered stream, no pre-buffering), so one enormous row
group is read within a fixed memory cap. A compressed Parquet object (.parquet.gz) is refused
with the fix: Parquet compresses its pages itself.
"""

from __future__ import annotations

from typing import BinaryIO, Iterator

import pyarrow.parquet as pq

from batchinf.formats.compression import codec_of
from batchinf.formats.record import FIELD_KEY, MAX_LINE_BYTES, InputRecord, _check, record_id_of

PARQUET_BATCH_ROWS = 1024


def read_parquet(fh: BinaryIO, uri: str, id_field: str, text_field: str, *,
                 kind: str = "text") -> Iterator[InputRecord]:
    """Records of a Parquet object, streamed page by page (a buffered stream, no pre-buffering),
    so a file with one enormous row group is read within a fixed memory cap."""
    if codec_of(fh, uri) is not None:
        yield InputRecord(0, None, None, "unsupported_compression",
                          f"{uri}: a compressed Parquet file cannot be read as a stream; Parquet "
                          "compresses its pages itself, so upload it uncompressed (e.g. with "
                          "compression='zstd' inside the file)")
        return
    pf = pq.ParquetFile(fh, buffer_size=1 << 20, pre_buffer=False)
    names = pf.schema_arrow.names
    if kind == "record":      # every column: the task reads the fields it needs
        yield from _records(pf, uri, id_field)
        return
    missing = [f for f in (id_field, text_field) if f not in names]
    if missing:
        msg = (f"{uri}: has no column {missing[0]!r} (columns: {', '.join(names)}); "
               f"set input.id_field / {FIELD_KEY[kind]}")
        for i in range(pf.metadata.num_rows):
            yield InputRecord(i, None, None, "missing_column", msg)
        return
    ordinal = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[id_field, text_field]):
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


def _records(pf: pq.ParquetFile, uri: str, id_field: str) -> Iterator[InputRecord]:
    """Whole rows (kind record), the id read from `id_field`."""
    ordinal = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS):
        for row in batch.to_pylist():
            yield _check(ordinal, row.get(id_field), row, f"{uri} row {ordinal}", id_field, "", "record")
            ordinal += 1
