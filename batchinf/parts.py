"""Parquet files in object stores: write with a digest, read back. Schemas of the output contract."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchinf import failpoints
from batchinf.digests import sha256_file
from batchinf.store import get_store, join, parse_uri
from batchinf.tasks.embed import embedding_schema  # noqa: F401 -- the result schemas live with their tasks
from batchinf.tasks.generate import GENERATION_SCHEMA  # noqa: F401

ERROR_SCHEMA = pa.schema([
    ("record_id", pa.string()), ("source", pa.string()), ("ordinal", pa.int64()),
    ("error", pa.string()), ("message", pa.string()), ("attempts", pa.int32()),
])


def error_row(record_id: str | None, source: str, ordinal: int, error: str, message: str,
              attempts: int) -> dict[str, Any]:
    """One row of ERROR_SCHEMA: the record (by id and by place), its error code and message."""
    return {"record_id": record_id, "source": source, "ordinal": ordinal, "error": error, "message": message,
            "attempts": attempts}


STAGE_ROW_GROUP = 1024   # rows per row group in staged files: what a worker holds at once


def codec(schema: pa.Schema) -> str:
    """A file's Parquet codec: zstd, but lz4 where a column is binary (staged audio samples, image
    bytes). Such payloads are dense already: zstd shrinks 16-bit PCM by a quarter in 16x lz4's
    time (a 2.5-minute file: 81 ms to write and 62 to read, against 5 and 2), paid on the critical
    path by planning's staged and shard files and by each worker's read. One codec per file,
    since pyarrow's per-column codecs name nested columns by their leaves."""
    return "lz4" if any(pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type) for f in schema) else "zstd"


def write_table(uri: str, table: pa.Table, row_group_size: int | None = None) -> str:
    """Write a Parquet file to uri (atomically for local files); returns its sha256."""
    fd, tmp = tempfile.mkstemp(suffix=".parquet")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression=codec(table.schema), row_group_size=row_group_size)
        digest = sha256_file(tmp)
        get_store(uri).put_file(uri, tmp)
        return digest
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_scratch_table(uri: str, table: pa.Table, row_group_size: int | None = None) -> int:
    """Write a scratch Parquet file, one the job re-creates when it is lost (planning's staged
    files): encoded in memory (a small file costs one write, not a temporary file, its hash and a
    copy) and stored without fsync (Store.put_bytes, durable=False). Returns its size in bytes."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression=codec(table.schema), row_group_size=row_group_size)
    data = sink.getvalue().to_pybytes()
    get_store(uri).put_bytes(uri, data, durable=False)
    return len(data)


class PartWriter:
    """Streams tables into one local Parquet file; `finish` uploads it and returns (sha256, rows)."""

    def __init__(self, schema: pa.Schema) -> None:
        fd, self.path = tempfile.mkstemp(suffix=".parquet")
        os.close(fd)
        self.writer = pq.ParquetWriter(self.path, schema, compression="zstd")
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        if table.num_rows:
            self.writer.write_table(table)
            self.rows += table.num_rows

    def finish(self, uri: str, metadata: dict[str, str] | None = None) -> tuple[str, int]:
        """Close the file (with `metadata` in its footer), upload it; its (sha256, rows)."""
        if metadata:
            self.writer.add_key_value_metadata(metadata)
        self.writer.close()
        try:
            digest = sha256_file(self.path)
            get_store(uri).put_file(uri, self.path)
            return digest, self.rows
        finally:
            os.unlink(self.path)

    def discard(self) -> None:
        self.writer.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


# An attempt whose task returned piece outputs (`RunOutput.pieces`: pieces of records staged in
# several rows) writes them beside its part, and names them in its part's footer under PIECES_KEY
# with their sha256 and rows, so the part's digest in the ledger vouches for them too.
PIECES_FILE = "pieces.parquet"
PIECES_KEY = "batchinf.pieces"


def pieces_footer(sha256: str, rows: int) -> dict[str, str]:
    """The part footer entry naming the attempt's piece outputs (beside the part, PIECES_FILE)."""
    return {PIECES_KEY: json.dumps({"key": PIECES_FILE, "sha256": sha256, "rows": rows})}


def pieces_of(part_uri: str, part_path: str) -> dict[str, Any] | None:
    """The piece outputs a part's footer names (uri, sha256, rows), read from its local copy; None
    when it names none."""
    meta = pq.read_metadata(part_path).metadata or {}
    raw = meta.get(PIECES_KEY.encode())
    if raw is None:
        return None
    ref = json.loads(raw)
    return {"uri": join(part_uri.rsplit("/", 1)[0], ref["key"]), "sha256": ref["sha256"], "rows": int(ref["rows"])}


STAGED_FILES = "files"    # under an attempt's prefix: the files it writes besides its parts


def staged_file(part_uri: str, key: str) -> str:
    """Where the attempt that wrote the part at `part_uri` staged the file that publish copies to
    `key` under the output prefix (generate_image's images): beside the part, under `files/`."""
    return join(part_uri.rsplit("/", 1)[0], STAGED_FILES, key)


class AttemptFiles:
    """An attempt's files besides its parts, staged under its own prefix (`staged_file`): a losing
    or failed attempt's are deleted with its prefix, and only the committed attempt's are copied
    under the output prefix, at publish. `put` may be called from several threads."""

    def __init__(self, part_uri: str, attempt: int) -> None:
        self.part_uri, self.attempt = part_uri, attempt
        self._lock = threading.Lock()
        self.count = 0

    def put(self, key: str, data: bytes) -> None:
        """Stage `data` for `key` (relative to the output prefix, e.g. `images/<name>.png`)."""
        uri = staged_file(self.part_uri, key)
        get_store(uri).put_bytes(uri, data)
        with self._lock:
            self.count += 1
            n = self.count
        if failpoints.active():     # e.g. execute.file[a1:3]=crash: attempt 1 dies at its third file
            failpoints.hit(f"execute.file[a{self.attempt}:{n}]")


@contextmanager
def local_copy(uri: str, suffix: str = ".parquet") -> Iterator[str]:
    """A local path with the object's bytes: a file:// object's own path, or a temporary copy of
    a remote one (removed on exit). Read-only use: the path may be the stored object itself."""
    scheme, _, path = parse_uri(uri)
    if scheme == "file":
        yield path
        return
    with tempfile.NamedTemporaryFile(suffix=suffix) as tmp:
        get_store(uri).download_file(uri, tmp.name)
        yield tmp.name


@contextmanager
def open_parquet(uri: str) -> Iterator[pq.ParquetFile]:
    """A ParquetFile for random access: local files in place, remote ones via a temp copy."""
    with local_copy(uri) as path:
        yield pq.ParquetFile(path)


def read_table(uri: str, columns: list[str] | None = None) -> pa.Table:
    """The whole Parquet object (or the given columns) as one table."""
    with local_copy(uri) as path:
        return pq.read_table(path, columns=columns)
