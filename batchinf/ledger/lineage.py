"""A job's history and lineage: keyset pages of its attempts (for the shard timeline), its
throughput over time, the records a retry selects (error rows by code, not-done shards' staged
files) and the retry jobs of a job."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select

from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.states import SHARD_DONE, AttemptStatus, ShardStatus, values
from batchinf.ledger.jobs import row as job_row
from batchinf.ledger.status import _fetch_page, decode_cursor, encode_cursor
from batchinf.ledger.tables import attempts, job_events, record_errors, retry_records, shards

# what an attempt came to, as the shard timeline colours it
OUTCOMES = ("running", "committed", "retried", "failed", "lost", "quarantined", "superseded")


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


# --- retries ---------------------------------------------------------------------------------------


def error_records(job_id: str, codes: list[str] | None) -> list[tuple[str, int]]:
    """(source, ordinal) of the job's committed error rows of these codes (None: every code)."""
    e = record_errors.c
    q = select(e.source, e.ordinal).where(e.job_id == job_id)
    if codes is not None:
        q = q.where(e.error.in_(codes))
    with tx() as conn:
        return [(src, int(o)) for src, o in conn.execute(q).all()]


def unfinished_shard_files(job_id: str) -> list[str]:
    """Staged files of the job's shards that are not done (neither committed nor quarantined):
    the records nobody accounted for."""
    with tx() as conn:
        return list(conn.execute(select(shards.c.input_uri).where(
            shards.c.job_id == job_id, shards.c.status.not_in(values(SHARD_DONE)))
            .order_by(shards.c.bucket, shards.c.ordinal)).scalars())


def has_shards(job_id: str) -> bool:
    with tx() as conn:
        return conn.execute(select(shards.c.id).where(shards.c.job_id == job_id).limit(1)).first() is not None


def selects(job_id: str) -> bool:
    """Whether the job plans only selected records (a retry job's `selection`)."""
    with tx() as conn:
        return conn.execute(select(retry_records.c.job_id).where(retry_records.c.job_id == job_id).limit(1)
                            ).first() is not None


def kept(job_id: str, source: str) -> set[int]:
    """`selection(job_id).get(source, set())` for one object, read by its own rows (a job that
    `selects`)."""
    with tx() as conn:
        return {int(o) for o in conn.execute(select(retry_records.c.ordinal).where(
            retry_records.c.job_id == job_id, retry_records.c.source == source)).scalars()}


def selection(job_id: str) -> dict[str, set[int]] | None:
    """The records a retry job plans, by source uri; None when it plans every pinned record."""
    with tx() as conn:
        rows = conn.execute(select(retry_records.c.source, retry_records.c.ordinal)
                            .where(retry_records.c.job_id == job_id)).all()
    if not rows:
        return None
    out: dict[str, set[int]] = {}
    for src, o in rows:
        out.setdefault(src, set()).add(int(o))
    return out
