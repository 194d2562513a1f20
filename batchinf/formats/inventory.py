"""Input manifests (`input.manifest`): which objects a job reads, as (uri, version id) entries.

Two shapes:
- a JSONL list: one {"uri": ...} or {"bucket", "key"} object per line, each with an optional
  "version_id" (or "VersionId");
- an S3 Inventory `manifest.json` (CSV or Parquet inventories): its `files` are read from its
  `destinationBucket`; rows that are delete markers or not the latest version are skipped. CSV
  keys are URL-encoded by S3 and decoded here.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Callable
from urllib.parse import unquote_plus

from batchinf.errors import ManifestError
from batchinf.formats.compression import ExpansionLimit, decompressed
from batchinf.store import normalize_uri

Entry = tuple[str, str | None]   # object uri, version id (None: the current version)


def entries(uri: str, data: bytes, read: Callable[[str], bytes], count: Callable[[str], None] = lambda u: None,
            ) -> list[Entry]:
    """The objects `uri` (whose bytes are `data`) lists; `read(uri)` fetches an inventory's files
    (through the job's grant-scoped storage), `count(uri)` sees every entry as it is found (and
    may raise to stop: the bound on a job's objects)."""
    text = data.decode("utf-8")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict) and "files" in whole and "fileFormat" in whole:
        return _inventory(uri, whole, read, count)
    return _jsonl(uri, text, count)


def _jsonl(uri: str, text: str, count: Callable[[str], None]) -> list[Entry]:
    out: list[Entry] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if "uri" in entry:
                if "://" not in str(entry["uri"]) and not str(entry["uri"]).startswith("/"):
                    raise ManifestError(f"input manifest {uri} line {n}: uri {str(entry['uri'])[:200]!r} is neither a "
                                        "URI nor an absolute path; write s3://bucket/key or file:///absolute/path")
                obj = normalize_uri(entry["uri"])
            else:
                bucket = entry.get("bucket") or entry["Bucket"]
                obj = f"s3://{bucket}/{entry.get('key') or entry['Key']}"
            version = entry.get("version_id") or entry.get("VersionId")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"input manifest {uri} line {n}: expected a JSON object with uri, or "
                                f"bucket and key, and optional version_id ({exc})") from exc
        _counted(count, obj, f"input manifest {uri} line {n}")
        out.append((obj, version))
    return out


def _counted(count: Callable[[str], None], obj: str, where: str) -> None:
    """`count(obj)`, its refusal (a bound of the job) naming where the object was listed."""
    try:
        count(obj)
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}") from None


def _inventory(uri: str, manifest: dict, read: Callable[[str], bytes], count: Callable[[str], None]) -> list[Entry]:
    fmt = str(manifest["fileFormat"]).upper()
    if fmt not in ("CSV", "PARQUET"):
        raise ManifestError(f"S3 Inventory {uri} is {fmt}: batchinf reads CSV and Parquet inventories")
    dest = str(manifest.get("destinationBucket", "")).removeprefix("arn:aws:s3:::")
    files = manifest["files"]
    if not dest or not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("key"), str)
                                                          for f in files):
        raise ManifestError(f"S3 Inventory {uri} needs a destinationBucket and files: [{{\"key\": ...}}, ...]")
    out: list[Entry] = []
    for f in files:
        data_uri = f"s3://{dest}/{f['key']}"
        blob = read(data_uri)
        for row in _csv_rows(manifest, blob, data_uri) if fmt == "CSV" else _parquet_rows(blob, data_uri):
            if row.get("is_delete_marker") in ("true", True) or row.get("is_latest") in ("false", False):
                continue
            obj = f"s3://{row['bucket']}/{row['key']}"
            _counted(count, obj, f"S3 Inventory file {data_uri}")
            out.append((obj, row.get("version_id") or None))
    return out


_COLUMN = {"bucket": "bucket", "key": "key", "versionid": "version_id", "islatest": "is_latest",
           "isdeletemarker": "is_delete_marker", "version_id": "version_id", "is_latest": "is_latest",
           "is_delete_marker": "is_delete_marker"}


# An inventory file is decoded as a stream, bounded four ways: its decompressed bytes (the one
# bounded reader, BATCHINF_MAX_EXPANSION; and at most MAX_INVENTORY_BYTES, since the objects it
# lists are held until pinned), its line length and its rows; past any, or unreadable (csv, UTF-8,
# Parquet), the job fails with a ManifestError naming the file: permanent, never retried.
MAX_INVENTORY_LINE = 64 << 10        # S3 writes a row in well under 4 KiB (a key is at most 1 KiB, URL-encoded 3x)
MAX_INVENTORY_ROWS = 1_000_000       # objects one inventory file may list
MAX_INVENTORY_BYTES = 128 << 20      # decoded bytes of one inventory file (1M rows of ~130 bytes)
_FIX = "; check the inventory (or list the objects in a JSONL input manifest instead)"


def _refused(file: str, what: str) -> ManifestError:
    return ManifestError(f"S3 Inventory file {file}: {what}{_FIX}")


def _expansion(file: str, exc: ExpansionLimit) -> ManifestError:
    return _refused(file, f"decompresses past {exc.limit} bytes ({exc.multiple}x its compressed size, "
                          "BATCHINF_MAX_EXPANSION), a decompression bomb; the operator can raise BATCHINF_MAX_EXPANSION")


def _too_big(file: str) -> ManifestError:
    return _refused(file, f"decompresses past {MAX_INVENTORY_BYTES} bytes, the most one inventory file may hold; "
                          "split the inventory")


def _lines(blob: bytes, file: str) -> Iterator[str]:
    """The file's lines, decompressed (gzip, bz2, zstd: by magic bytes) a buffer at a time."""
    stream = decompressed(io.BytesIO(blob), file)
    n = total = 0
    try:
        while line := stream.readline(MAX_INVENTORY_LINE + 1):
            n += 1
            total += len(line)
            if len(line) > MAX_INVENTORY_LINE:
                raise _refused(file, f"line {n} is longer than {MAX_INVENTORY_LINE} bytes")
            if total > MAX_INVENTORY_BYTES:
                raise _too_big(file)
            yield line.decode("utf-8")
    except ExpansionLimit as exc:
        raise _expansion(file, exc) from None
    except UnicodeDecodeError as exc:
        raise _refused(file, f"line {n} is not UTF-8 text (byte {exc.start})") from None
    except (OSError, EOFError, ValueError) as exc:      # corrupt compressed data (pyarrow.ArrowInvalid is a ValueError)
        raise _refused(file, f"cannot be decompressed past line {n} ({str(exc)[:200]})") from None


def _csv_rows(manifest: dict, blob: bytes, file: str) -> Iterator[dict]:
    names = [_COLUMN.get(c.strip().lower(), c.strip().lower()) for c in str(manifest.get("fileSchema", "")).split(",")]
    if "bucket" not in names or "key" not in names:
        raise ManifestError(f"S3 Inventory fileSchema {manifest.get('fileSchema')!r} has no Bucket and Key")
    reader = csv.reader(_lines(blob, file))
    try:
        for values in reader:
            if reader.line_num > MAX_INVENTORY_ROWS:
                raise _refused(file, f"lists more than {MAX_INVENTORY_ROWS} objects")
            row = dict(zip(names, values))
            if "key" not in row or "bucket" not in row:
                raise _refused(file, f"line {reader.line_num} has {len(values)} columns, fewer than its fileSchema's")
            row["key"] = unquote_plus(row["key"])      # S3 writes CSV keys URL-encoded
            yield row
    except csv.Error as exc:
        raise _refused(file, f"is not valid CSV at line {reader.line_num} ({exc})") from None


def _parquet_rows(blob: bytes, file: str) -> Iterator[dict]:
    """The rows of a Parquet inventory file, a batch at a time, within the same bounds as a CSV's:
    its declared size (metadata) and the bytes it decodes to."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchinf.config import settings
    from batchinf.formats.compression import MIN_EXPANSION_BYTES

    multiple = settings().max_expansion
    limit = max(MIN_EXPANSION_BYTES, multiple * len(blob))
    try:
        pf = pq.ParquetFile(io.BytesIO(blob))
        meta = pf.metadata
        declared = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if meta.num_rows > MAX_INVENTORY_ROWS:
            raise _refused(file, f"lists {meta.num_rows} objects, more than {MAX_INVENTORY_ROWS}")
        if declared > limit:
            raise _expansion(file, ExpansionLimit(limit, multiple))
        if declared > MAX_INVENTORY_BYTES:
            raise _too_big(file)
        renamed = {c: _COLUMN.get(c.lower(), c.lower()) for c in pf.schema_arrow.names}
        wanted = [c for c, to in renamed.items() if to in ("bucket", "key", "version_id", "is_latest", "is_delete_marker")]
        if not {"bucket", "key"} <= {renamed[c] for c in wanted}:
            raise _refused(file, f"has no bucket and key columns (it has {', '.join(pf.schema_arrow.names)[:200]})")
        decoded = 0
        for batch in pf.iter_batches(batch_size=8192, columns=wanted):
            decoded += batch.nbytes
            if decoded > limit:
                raise _expansion(file, ExpansionLimit(limit, multiple))
            if decoded > MAX_INVENTORY_BYTES:
                raise _too_big(file)
            for row in batch.to_pylist():
                yield {renamed[k]: v for k, v in row.items()}
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise _refused(file, f"is not a readable Parquet file ({str(exc)[:200]})") from None
