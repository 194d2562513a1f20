"""What one planning task leaves beside its staged object so that the global step never reads
every record: the staged rows sorted by (token length, ordinal), a compact summary (token-length
histograms of its valid and invalid records, counts, a sample of its ids; for generate, the
max_tokens of its valid records by length, their decode work), and its valid ids
sorted, for the job-wide duplicate check by id ranges (bucketing.py).

Files beside plan/obj-00000.parquet:
  plan/obj-00000.summary.json   the summary (size: distinct lengths + a bounded id sample)
  plan/obj-00000.ids.parquet    record_id, ordinal, n_tokens of valid records, sorted by id
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchinf.store import get_store

ID_SAMPLES = 128          # ids sampled per object: the global step splits the id space with them
IDS_ROW_GROUP = 8192      # rows per row group of an ids file: reading one id range skips the others


def summary_uri(stage_uri: str) -> str:
    return stage_uri.removesuffix(".parquet") + ".summary.json"


def ids_uri(stage_uri: str) -> str:
    return stage_uri.removesuffix(".parquet") + ".ids.parquet"


def in_stage_order(table: pa.Table) -> pa.Table:
    """Staged rows sorted by (token length, ordinal): the records of one length are one row range,
    in the order the global step cuts them into shards."""
    return table.sort_by([("n_tokens", "ascending"), ("ordinal", "ascending")])


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
    n_tokens = table.column("n_tokens").to_numpy().astype(np.int64)
    errors = table.column("error")
    valid = errors.is_null().to_numpy(zero_copy_only=False)
    truncated = np.asarray(table.column("truncated").to_numpy(zero_copy_only=False), dtype=bool)
    step = max(1, -(-ids.num_rows // ID_SAMPLES))
    bad = errors.filter(pa.array(kept & ~valid)).value_counts()
    return {
        "rows": table.num_rows, "records": int(kept.sum()), "tokens": int(n_tokens[kept].sum()),
        "truncated": int(truncated[kept].sum()),
        "valid": _histogram(n_tokens[kept & valid]), "invalid": _histogram(n_tokens[kept & ~valid]),
        "invalid_by_code": {str(v["values"]): int(v["counts"]) for v in bad.to_pylist()},
        "valid_extra": _extra(table, n_tokens, kept & valid),
        "ids": ids.num_rows, "id_step": step,
        "id_sample": ids.column("record_id").take(pa.array(np.arange(0, ids.num_rows, step))).to_pylist(),
    }


def write_summary(stage_uri: str, summary: dict[str, Any], durable: bool = True) -> None:
    uri = summary_uri(stage_uri)
    get_store(uri).put_bytes(uri, json.dumps(summary).encode(), durable)


def read_summary(stage_uri: str) -> dict[str, Any]:
    uri = summary_uri(stage_uri)
    return json.loads(get_store(uri).get_bytes(uri))
