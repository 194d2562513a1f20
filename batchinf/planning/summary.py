"""What one planning task leaves so that the global step never reads every record: the staged
rows sorted by (token length, ordinal) and, in that Parquet file's footer (key
`batchinf.summary`), a compact summary (token-length histograms of its valid and invalid
records, counts, a sample of its ids; for generate, the max_tokens of its valid records by
length, their decode work), and its valid ids sorted, for the job-wide duplicate check by id
ranges (bucketing.py). An object (part) of at most ID_SAMPLES valid ids has them all in its
summary (the sample is every id; `id_rows` adds their ordinals and lengths): its planning task
writes one file, and the global step opens one per object. A larger one has them in a file of
their own:
  plan/obj-00000.ids.parquet    record_id, ordinal, n_tokens of valid records, sorted by id
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinf.store import get_store, parse_uri
from batchinf.store.base import missing_error
from batchinf.tasks.base import PIECE

ID_SAMPLES = 128          # ids sampled per object: the global step splits the id space with them
IDS_ROW_GROUP = 8192      # rows per row group of an ids file: reading one id range skips the others


SUMMARY_KEY = b"batchinf.summary"   # the staged file's footer metadata key holding its summary


def ids_uri(stage_uri: str) -> str:
    return stage_uri.removesuffix(".parquet") + ".ids.parquet"


def in_stage_order(table: pa.Table) -> pa.Table:
    """Staged rows sorted by (token length, ordinal): the records of one length are one row range,
    in the order the global step cuts them into shards (a record's pieces of one length, by piece)."""
    keys = [("n_tokens", "ascending"), ("ordinal", "ascending")]
    return table.sort_by(keys + ([(PIECE, "ascending")] if PIECE in table.schema.names else []))


def continued(table: pa.Table | pa.RecordBatch) -> np.ndarray:
    """Rows that continue a record staged in pieces (tasks/base.py PIECE): work, not records."""
    if PIECE not in table.schema.names:
        return np.zeros(table.num_rows, dtype=bool)
    return pc.fill_null(table.column(PIECE), 0).to_numpy(zero_copy_only=False) > 0


def record_count(summary: dict[str, Any]) -> int:
    """The records of a staged object (part), from its summary: its rows, less those that continue
    a record staged in pieces."""
    return int(summary["rows"]) - int(summary.get("continued", 0))


def kept_mask(table: pa.Table, keep: set[int] | None) -> np.ndarray:
    """Rows the job plans: all, or (a retry job) the selected ordinals."""
    if keep is None:
        return np.ones(table.num_rows, dtype=bool)
    return np.isin(table.column("ordinal").to_numpy(), np.fromiter(keep, dtype=np.int64, count=len(keep)))


def _histogram(lengths: np.ndarray) -> list[list[int]]:
    values, counts = np.unique(lengths, return_counts=True)
    return [[int(v), int(c)] for v, c in zip(values, counts)]


def _extra(table: pa.Table, n_tokens: np.ndarray, rows: np.ndarray) -> list[list[int]]:
    """Per token length, the sum of the rows' max_tokens (generate: the tokens each may decode,
    part of its work); none for tasks without them."""
    if "max_tokens" not in table.schema.names:
        return []
    extra = pc.fill_null(table.column("max_tokens"), 0).to_numpy().astype(np.int64)[rows]
    values, where = np.unique(n_tokens[rows], return_inverse=True)
    sums = np.bincount(where, weights=extra, minlength=len(values)).astype(np.int64)
    return [[int(v), int(e)] for v, e in zip(values, sums) if e]


def valid_ids(table: pa.Table) -> pa.Table:
    """The rows the duplicate check compares (an id and no error), sorted by id then ordinal."""
    mask = pc.and_(pc.is_null(table.column("error")), pc.is_valid(table.column("record_id")))
    rows = table.filter(mask).select(["record_id", "ordinal", "n_tokens"])
    return rows.sort_by([("record_id", "ascending"), ("ordinal", "ascending")])


def summarize(table: pa.Table, keep: set[int] | None, ids: pa.Table) -> dict[str, Any]:
    """The object's summary: histograms of kept valid and invalid records by token length, kept
    counts (records, tokens, truncated, invalid by code), and an evenly spaced sample of its
    sorted valid ids with the number of ids each stands for."""
    kept = kept_mask(table, keep)
    more = continued(table)
    n_tokens = table.column("n_tokens").to_numpy().astype(np.int64)
    errors = table.column("error")
    valid = errors.is_null().to_numpy(zero_copy_only=False)
    truncated = np.asarray(table.column("truncated").to_numpy(zero_copy_only=False), dtype=bool)
    step = max(1, -(-ids.num_rows // ID_SAMPLES))
    bad = errors.filter(pa.array(kept & ~valid)).value_counts()
    return {
        # rows: staged rows; records: kept records (a record staged in pieces once: `continued` rows aside)
        "rows": table.num_rows, "records": int((kept & ~more).sum()), "continued": int(more.sum()),
        "tokens": int(n_tokens[kept].sum()),
        "truncated": int(truncated[kept].sum()),
        "valid": _histogram(n_tokens[kept & valid]), "invalid": _histogram(n_tokens[kept & ~valid]),
        "invalid_by_code": {str(v["values"]): int(v["counts"]) for v in bad.to_pylist()},
        "valid_extra": _extra(table, n_tokens, kept & valid),
        "ids": ids.num_rows, "id_step": step,
        "id_sample": ids.column("record_id").take(pa.array(np.arange(0, ids.num_rows, step))).to_pylist(),
        # few ids: the sample is all of them; with their ordinals and lengths no ids file is needed
        **({"id_rows": {"ordinal": ids.column("ordinal").to_pylist(), "n_tokens": ids.column("n_tokens").to_pylist()}}
           if ids.num_rows <= ID_SAMPLES else {}),
    }


def has_ids_file(summary: dict[str, Any]) -> bool:
    """Whether the object's (part's) valid ids are in a file of their own, not in its summary."""
    return "id_rows" not in summary


def inline_ids(summary: dict[str, Any]) -> pa.Table:
    """The ids table of an object whose summary holds all its valid ids (as its ids file would be)."""
    rows = summary["id_rows"]
    return pa.table({"record_id": pa.array(summary["id_sample"], pa.string()),
                     "ordinal": pa.array(rows["ordinal"], pa.int64()),
                     "n_tokens": pa.array(rows["n_tokens"], pa.int32())})


def with_summary(table: pa.Table, summary: dict[str, Any]) -> pa.Table:
    """The staged table with its summary in its schema metadata (written into the file's footer)."""
    meta = dict(table.schema.metadata or {})
    meta[SUMMARY_KEY] = json.dumps(summary).encode()
    return table.replace_schema_metadata(meta)


def without_summary(table: pa.Table) -> pa.Table:
    """Staged rows as read back, without the summary in their schema (shard files do not carry it)."""
    meta = table.schema.metadata
    if not meta or SUMMARY_KEY not in meta:
        return table
    return table.replace_schema_metadata({k: v for k, v in meta.items() if k != SUMMARY_KEY} or None)


def read_summary(stage_uri: str) -> dict[str, Any]:
    """The summary in a staged file's footer (a remote file's footer is read by ranged reads).
    Raises InputError when the file is missing, ValueError when it is torn (no whole footer)."""
    scheme, _, path = parse_uri(stage_uri)
    try:
        if scheme == "file":
            if not os.path.exists(path):
                raise missing_error(stage_uri)
            meta = pq.read_metadata(path).metadata
        else:
            store = get_store(stage_uri)
            with store.open_ranged(store.head(stage_uri), 1 << 16) as f:
                meta = pq.read_metadata(f).metadata
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"staged file {stage_uri} is torn: {exc}") from exc
    if not meta or SUMMARY_KEY not in meta:
        raise ValueError(f"staged file {stage_uri} has no summary")
    return json.loads(meta[SUMMARY_KEY])
