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
import gzip
import io
import json
from typing import Callable
from urllib.parse import unquote_plus

from batchinf.errors import ManifestError
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
                obj = normalize_uri(entry["uri"])
            else:
                bucket = entry.get("bucket") or entry["Bucket"]
                obj = f"s3://{bucket}/{entry.get('key') or entry['Key']}"
            version = entry.get("version_id") or entry.get("VersionId")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"input manifest {uri} line {n}: expected a JSON object with uri, or "
                                f"bucket and key, and optional version_id ({exc})") from exc
        count(obj)
        out.append((obj, version))
    return out


def _inventory(uri: str, manifest: dict, read: Callable[[str], bytes], count: Callable[[str], None]) -> list[Entry]:
    fmt = str(manifest["fileFormat"]).upper()
    if fmt not in ("CSV", "PARQUET"):
        raise ManifestError(f"S3 Inventory {uri} is {fmt}: batchinf reads CSV and Parquet inventories")
    dest = str(manifest.get("destinationBucket", "")).removeprefix("arn:aws:s3:::")
    if not dest:
        raise ManifestError(f"S3 Inventory {uri} names no destinationBucket")
    out: list[Entry] = []
    for f in manifest["files"]:
        blob = read(f"s3://{dest}/{f['key']}")
        rows = _csv_rows(manifest, blob) if fmt == "CSV" else _parquet_rows(blob)
        for row in rows:
            if row.get("is_delete_marker") in ("true", True) or row.get("is_latest") in ("false", False):
                continue
            obj = f"s3://{row['bucket']}/{row['key']}"
            count(obj)
            out.append((obj, row.get("version_id") or None))
    return out


_COLUMN = {"bucket": "bucket", "key": "key", "versionid": "version_id", "islatest": "is_latest",
           "isdeletemarker": "is_delete_marker", "version_id": "version_id", "is_latest": "is_latest",
           "is_delete_marker": "is_delete_marker"}


def _csv_rows(manifest: dict, blob: bytes) -> list[dict]:
    names = [_COLUMN.get(c.strip().lower(), c.strip().lower()) for c in str(manifest.get("fileSchema", "")).split(",")]
    if "bucket" not in names or "key" not in names:
        raise ManifestError(f"S3 Inventory fileSchema {manifest.get('fileSchema')!r} has no Bucket and Key")
    text = gzip.decompress(blob).decode("utf-8") if blob[:2] == b"\x1f\x8b" else blob.decode("utf-8")
    rows = []
    for values in csv.reader(io.StringIO(text)):
        row = dict(zip(names, values))
        row["key"] = unquote_plus(row["key"])      # S3 writes CSV keys URL-encoded
        rows.append(row)
    return rows


def _parquet_rows(blob: bytes) -> list[dict]:
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(blob))
    table = table.rename_columns([_COLUMN.get(c.lower(), c.lower()) for c in table.column_names])
    return table.select([c for c in ("bucket", "key", "version_id", "is_latest", "is_delete_marker")
                         if c in table.column_names]).to_pylist()
