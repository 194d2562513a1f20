"""A job's history: keyset pages of its attempts with their outcome (the dashboard's shard
timeline) and its throughput over time."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select

from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.jobs import row as job_row
from batchinf.ledger.states import AttemptStatus, ShardStatus
from batchinf.ledger.status import _fetch_page, decode_cursor, encode_cursor
from batchinf.ledger.tables import attempts, job_events, shards

# what an attempt came to, as the shard timeline colours it
OUTCOMES = ("running", "committed", "retried", "failed", "lost", "released", "quarantined", "superseded")


def _outcome(status: str, shard_status: str) -> str:
    if status == AttemptStatus.FAILED:
        return "failed" if shard_status == ShardStatus.FAILED else "retried"
    if status == AttemptStatus.LOST:
        return "quarantined" if shard_status == ShardStatus.QUARANTINED else "lost"
    return status


def page_attempts(job_id: str, *, tenant: str | None = None, limit: int = 500,
                  cursor: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """A job's attempts in (started_at, shard, number) order, one page at a time, each with its
    `outcome`: a swept attempt (a loser whose files were deleted) reports what it had lost as."""
    job_row(job_id, tenant=tenant)
    a, s = attempts.c, shards.c
    q = (select(a.shard_id, s.bucket, s.ordinal.label("shard_ordinal"), a.number, a.worker, a.status,
                s.status.label("shard_status"), a.started_at, a.heartbeat_at, a.finished_at, a.error)
         .join(shards, s.id == a.shard_id).where(s.job_id == job_id)
         .order_by(a.started_at, a.shard_id, a.number))
    if cursor:
        t, shard_id, number = decode_cursor(cursor, (int, float), str, int)
        q = q.where((a.started_at > t) | ((a.started_at == t) & (a.shard_id > shard_id))
                    | ((a.started_at == t) & (a.shard_id == shard_id) & (a.number > number)))
    rows, more = _fetch_page(q, limit)
    before_sweep: dict[tuple[str, int], str] = {}
    if any(r.status == AttemptStatus.SWEPT for r in rows):
        with tx() as conn:
            for shard_id, frm, detail in conn.execute(
                    select(job_events.c.shard_id, job_events.c.from_status, job_events.c.detail)
                    .where(job_events.c.job_id == job_id, job_events.c.kind == "attempt",
                           job_events.c.to_status == AttemptStatus.SWEPT.value)).all():
                before_sweep[(shard_id, int(json.loads(detail or "{}").get("attempt", 0)))] = frm
    items = []
    for r in rows:
        m = dict(r._mapping)
        was = before_sweep.get((r.shard_id, r.number), r.status) if r.status == AttemptStatus.SWEPT else r.status
        m["outcome"] = _outcome(was, m.pop("shard_status"))
        items.append(m)
    nxt = encode_cursor(rows[-1].started_at, rows[-1].shard_id, rows[-1].number) if more else None
    return items, nxt


def throughput(job_id: str, *, tenant: str | None = None, points: int = 60) -> dict[str, Any]:
    """Records and input tokens committed per interval, from the committing attempts' finish
    times, in `points` equal intervals from the job's start to its end (or now)."""
    row = job_row(job_id, tenant=tenant)
    a, s = attempts.c, shards.c
    with tx() as conn:
        done = conn.execute(select(a.finished_at, s.num_records, s.tokens_input)
                            .join(shards, s.id == a.shard_id)
                            .where(s.job_id == job_id, a.status == AttemptStatus.COMMITTED.value,
                                   a.finished_at.is_not(None))).all()
    start = row.started_at or row.created_at
    end = max([row.finished_at or now(), *(d.finished_at for d in done)])
    width = max((end - start) / points, 1e-3)
    series = [{"t": start + i * width, "records": 0, "tokens": 0} for i in range(points)]
    for d in done:
        p = series[min(points - 1, max(0, int((d.finished_at - start) / width)))]
        p["records"] += int(d.num_records)
        p["tokens"] += int(d.tokens_input or 0)
    for p in series:
        p["records_per_second"] = p["records"] / width
    return {"job_id": job_id, "start": start, "end": end, "interval_seconds": width, "points": series}
