"""Poison isolation. A quarantined shard (its attempts' workers died while running its records,
on more than one host where the fleet has several: `RetryPolicy.end_attempt`) is split into two
child shards, recursively, until the killing record is alone; a one-record quarantined shard
becomes a `poison` error row (one a record: a record staged in pieces may be poisoned by
several). Every other record still gets its result."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute  # noqa: F401 -- pa.compute

from batchinf.ledger import shards as shard_repo
from batchinf.ledger.models import Job, Shard
from batchinf.parts import ERROR_SCHEMA, STAGE_ROW_GROUP, error_row, read_table, write_table
from batchinf.planning.shard_names import shard_file, shard_id
from batchinf.store import join
from batchinf.tasks.base import PIECE


def resolve_quarantined(job: Job) -> int:
    """Split or record every unresolved quarantined shard of the job; returns how many.
    Idempotent: a shard already split or recorded is skipped."""
    todo = shard_repo.unresolved_quarantined(job.id)
    for sh in todo:
        staged = read_table(sh.input_uri)
        if staged.num_rows == 1:
            _record_poison(job, sh, staged)
            continue
        top = shard_repo.next_ordinal(job.id, sh.bucket)
        half = staged.num_rows // 2
        children = []
        for k, part in enumerate((staged.slice(0, half), staged.slice(half))):
            uri = shard_file(job.work_uri, sh.bucket, top + k)
            write_table(uri, part, row_group_size=STAGE_ROW_GROUP)
            children.append({"id": shard_id(f"{sh.id}|{k}"), "bucket": sh.bucket, "ordinal": top + k,
                             "num_records": part.num_rows, "input_uri": uri,
                             "num_tokens": int(pa.compute.sum(part.column("n_tokens")).as_py() or 0)})
        shard_repo.split(sh, children)
    return len(todo)


def _record_poison(job: Job, sh: Shard, staged: pa.Table) -> None:
    r = staged.to_pylist()[0]
    source = staged.column("source").cast(pa.string())[0].as_py()
    where = f"{source} record {r['ordinal']}"
    if (r.get("pieces") or 1) > 1:      # a piece of a record staged in several
        where += f", piece {r[PIECE] + 1} of {r['pieces']}"
    row = error_row(r["record_id"], source, r["ordinal"], "poison",
                    f"record {r['record_id']!r} ({where}) killed the worker process running it (its shard's "
                    f"attempts ran out: {sh.attempt}); quarantined", sh.attempt)
    first = not shard_repo.poisoned(job.id, source, r["ordinal"])
    uri = join(job.work_uri, "attempts", sh.id, "poison", "errors.parquet")
    sha = write_table(uri, pa.Table.from_pylist([row] if first else [], schema=ERROR_SCHEMA))
    shard_repo.record_poison(sh, row, uri, sha, first)
