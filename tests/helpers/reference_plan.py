"""The global planning step as it was before it worked from summaries: every staged record in
memory, duplicates found with one dict, shards taken from the concatenated table. Tests compare
the bounded-memory step (batchinf/planning/bucketing.py) with it, shard file by shard file."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from batchinf.planning.bucketing import ERROR_BUCKET
from batchinf.planning.shard_names import shard_id


def bucket_bounds(lengths: np.ndarray, max_records: int, max_buckets: int = 32) -> list[int]:
    """Upper bounds (inclusive) of length buckets, from the job's own length distribution:
    quantile cut points, so each bucket holds a similar number of records, and no more buckets
    than it takes to keep shards near full (a bucket is cut into shards of max_records). The
    planner computes the same from a histogram (`bucketing.bounds_from_histogram`)."""
    if lengths.size == 0:
        return []
    n = int(min(max_buckets, max(1, -(-lengths.size // max_records))))
    qs = np.quantile(lengths, np.linspace(0, 1, n + 1)[1:], method="higher")
    return sorted({int(q) for q in qs})


def cut(order: np.ndarray, tokens: np.ndarray, max_records: int, max_tokens: int) -> list[np.ndarray]:
    """Split an ordered index array into runs bounded by record count and token sum (the planner
    cuts runs of equal-length records the same way: `bucketing.cut_groups`)."""
    runs, start, acc = [], 0, 0
    for i, idx in enumerate(order):
        t = int(tokens[idx])
        if i > start and (i - start >= max_records or acc + t > max_tokens):
            runs.append(order[start:i])
            start, acc = i, 0
        acc += t
    if start < len(order):
        runs.append(order[start:])
    return runs


def reference_shards(job_id: str, uris: list[str], staged: list[pa.Table], max_records: int, max_tokens: int,
                     chosen: dict[str, set[int]] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(shards: bucket, ordinal, id, num_records, num_tokens, table; plan: bounds and counts)."""
    tables = [t.sort_by("ordinal") for t in staged]          # pinned order: object, then ordinal
    table = pa.concat_tables(tables)
    src = np.repeat(np.arange(len(tables), dtype=np.int64), [t.num_rows for t in tables])
    ordinal = table.column("ordinal").to_numpy()
    n_tokens = table.column("n_tokens").to_numpy().astype(np.int64)
    errors = table.column("error").to_pylist()
    messages = table.column("message").to_pylist()
    ids = table.column("record_id").to_pylist()
    seen: dict[str, int] = {}
    for i, rid in enumerate(ids):
        if rid is None or errors[i] is not None:
            continue
        first = seen.setdefault(rid, i)
        if first != i:
            errors[i] = "duplicate_id"
            messages[i] = (f"{uris[src[i]]} record {ordinal[i]}: id {rid!r} duplicates the record at "
                           f"{uris[src[first]]} record {ordinal[first]}; ids must be unique in a job")
    keep = (np.ones(len(ordinal), dtype=bool) if chosen is None else
            np.array([int(o) in chosen.get(uris[s], ()) for s, o in zip(src, ordinal)], dtype=bool))
    valid = np.array([e is None for e in errors], dtype=bool)
    bounds = bucket_bounds(n_tokens[valid & keep], max_records)
    bucket = np.where(valid, np.searchsorted(np.asarray(bounds, dtype=np.int64), n_tokens), ERROR_BUCKET)
    full = table.set_column(table.schema.get_field_index("error"), "error", pa.array(errors, pa.string()))
    full = full.set_column(full.schema.get_field_index("message"), "message", pa.array(messages, pa.string()))
    full = full.append_column("source", pa.DictionaryArray.from_arrays(pa.array(src, pa.int32()),
                                                                       pa.array(uris, pa.string())))
    shards = []
    for b in sorted(set(bucket[keep].tolist())):
        members = np.flatnonzero((bucket == b) & keep)
        members = members[np.lexsort((ordinal[members], src[members], n_tokens[members]))]
        for k, run in enumerate(cut(members, n_tokens, max_records, max_tokens)):
            key = np.ascontiguousarray(np.stack([src[run], ordinal[run]], axis=1), dtype=np.int64).tobytes()
            shards.append({"bucket": int(b), "ordinal": k, "id": shard_id(f"{job_id}|{int(b)}|{k}|", key),
                           "num_records": len(run), "num_tokens": int(n_tokens[run].sum()),
                           "table": full.take(pa.array(run))})
    plan = {"bucket_bounds": bounds, "records": int(keep.sum()), "invalid": int((~valid & keep).sum()),
            "truncated": int(np.asarray(table.column("truncated").to_numpy(zero_copy_only=False))[keep].sum()),
            "tokens": int(n_tokens[keep].sum())}
    return shards, plan
