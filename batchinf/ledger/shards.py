"""The shard repository: shard transitions, dispatch, tail detection and quarantine bookkeeping.
(Leases, heartbeats and commits are in `leases.py`.)"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, and_, func, insert, select, update

from batchinf.engines import Route
from batchinf.errors import LedgerError
from batchinf.ledger import events, tallies
from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.jobs import transition as transition_job
from batchinf.ledger.models import Demand, Shard, bounded_error
from batchinf.ledger.states import (JOB_PLANNING, SHARD_DONE, SHARD_IN_FLIGHT, SHARD_WAITING, AttemptStatus,
                                    JobStatus, ShardStatus, shard_sources, values)
from batchinf.ledger.tables import attempts, jobs, record_errors, shards


def transition(conn: Connection, shard_id: str, to: ShardStatus, *, fence: int | None = None,
               where: Any = None, detail: Any = None, **fields: Any) -> bool:
    """Move a shard to `to`; with `fence`, only if that attempt still holds the fencing token;
    with `where`, only if that extra condition holds too (checked in the same UPDATE)."""
    row = conn.execute(select(shards.c.job_id, shards.c.status).where(shards.c.id == shard_id)).first()
    if row is None:
        raise LedgerError(f"no shard {shard_id!r}")
    cond = [shards.c.id == shard_id, shards.c.status.in_(shard_sources(to))]
    if fence is not None:
        cond.append(shards.c.attempt == fence)
    if where is not None:
        cond.append(where)
    if conn.execute(update(shards).where(*cond).values(status=to.value, updated_at=now(), **fields)).rowcount != 1:
        return False
    events.record(conn, row.job_id, "shard", row.status, to.value, shard_id=shard_id, detail=detail)
    return True


def get(shard_id: str) -> Shard:
    with tx() as conn:
        row = conn.execute(select(shards).where(shards.c.id == shard_id)).first()
    if row is None:
        raise LedgerError(f"no shard {shard_id!r}")
    return Shard.from_row(row)


def routes_of(shard_ids: list[str]) -> dict[str, Route]:
    """shard id -> the engine and device its job runs on (the queue a broker sends it to)."""
    with tx() as conn:
        rows = conn.execute(select(shards.c.id, jobs.c.engine, jobs.c.device).join(jobs, jobs.c.id == shards.c.job_id)
                            .where(shards.c.id.in_(shard_ids))).all()
    return {r.id: Route(r.engine, r.device) for r in rows}


def of_job(job_id: str) -> list[Shard]:
    """Every shard of the job in (bucket, ordinal) order."""
    with tx() as conn:
        rows = conn.execute(select(shards).where(shards.c.job_id == job_id)
                            .order_by(shards.c.bucket, shards.c.ordinal)).all()
    return [Shard.from_row(r) for r in rows]


def counts(conn: Connection, job_id: str) -> dict[str, int]:
    rows = conn.execute(select(shards.c.status, func.count()).where(shards.c.job_id == job_id)
                        .group_by(shards.c.status)).all()
    return {status: n for status, n in rows}


def dispatch_ready(job_id: str, limit: int | None = None) -> list[str]:
    """pending and retrying-past-backoff shards become queued; returns their ids (bounded by limit).
    Two index range scans (pending shards in dispatch order, retrying ones), never a sort of
    every pending shard of the job."""
    order = (shards.c.bucket.desc(), shards.c.ordinal)
    with tx() as conn:
        pending = select(shards.c.id, shards.c.bucket, shards.c.ordinal, shards.c.status).where(
            shards.c.job_id == job_id, shards.c.status == ShardStatus.PENDING.value).order_by(*order)
        retrying = select(shards.c.id, shards.c.bucket, shards.c.ordinal, shards.c.status).where(
            shards.c.job_id == job_id, shards.c.status == ShardStatus.RETRYING.value,
            func.coalesce(shards.c.not_before, 0) <= now()).order_by(*order)
        if limit is not None:
            pending, retrying = pending.limit(limit), retrying.limit(limit)
        rows = sorted([*conn.execute(pending).all(), *conn.execute(retrying).all()], key=lambda r: (-r.bucket, r.ordinal))
        chosen = rows if limit is None else rows[:limit]
        if not chosen:
            return []
        # one bulk transition (the state table's edges, as `transition` checks them one by one)
        moved = set(conn.execute(update(shards).where(
            shards.c.id.in_([r.id for r in chosen]), shards.c.status.in_(shard_sources(ShardStatus.QUEUED)))
            .values(status=ShardStatus.QUEUED.value, updated_at=now()).returning(shards.c.id)).scalars())
        events.record_shards(conn, job_id, [(r.id, r.status, ShardStatus.QUEUED.value) for r in chosen if r.id in moved])
        return [r.id for r in chosen if r.id in moved]


UNPLANNED_DEMAND = 1 << 30   # a job still planning claims every slot it outranks: kept free for it


def dispatch_demand(cap: int = 1 << 16) -> list[Demand]:
    """Each active job's slots in use and shards ready to dispatch (counted up to `cap`: a share
    never exceeds the fleet's slots). A job still being planned counts as wanting every slot, so
    lower-priority jobs do not fill the fleet meanwhile. Per job: index range counts, not a scan
    of its shards."""
    planning = values(JOB_PLANNING)
    t = now()
    with tx() as conn:
        rows = conn.execute(
            select(jobs.c.id, jobs.c.status, jobs.c.priority, jobs.c.deadline_at, jobs.c.created_at, jobs.c.hold,
                   jobs.c.engine, jobs.c.device)
            .where(jobs.c.status.in_([JobStatus.RUNNING.value, *planning]))).all()
        out = []
        for r in rows:
            def upto(*cond: Any, job_id: str = r.id) -> int:
                sub = select(shards.c.id).where(shards.c.job_id == job_id, *cond).limit(cap).subquery()
                return int(conn.execute(select(func.count()).select_from(sub)).scalar() or 0)
            in_flight = upto(shards.c.status.in_(values(SHARD_IN_FLIGHT)))
            ready = upto(shards.c.status == ShardStatus.PENDING.value) + upto(
                shards.c.status == ShardStatus.RETRYING.value, func.coalesce(shards.c.not_before, 0) <= t)
            planned_later = r.status in planning and not r.hold          # a dry run will not dispatch
            out.append(Demand(r.id, r.priority, r.deadline_at, r.created_at, in_flight,
                              UNPLANNED_DEMAND if planned_later else min(ready, cap), Route(r.engine, r.device)))
    return out


def mark_dispatched(shard_ids: list[str]) -> None:
    if shard_ids:
        with tx() as conn:
            conn.execute(update(shards).where(shards.c.id.in_(shard_ids)).values(dispatched_at=now()))


def stale_queued(job_id: str, older_than: float) -> list[str]:
    """Queued shards whose last message is older than `older_than` seconds: the message may be
    lost (broker flushed or restarted), so it is sent again. A duplicate is harmless."""
    with tx() as conn:
        return conn.execute(select(shards.c.id).where(
            shards.c.job_id == job_id, shards.c.status == ShardStatus.QUEUED.value,
            func.coalesce(shards.c.dispatched_at, 0) < now() - older_than)).scalars().all()


def _any_open(conn: Connection, job_id: str) -> bool:
    """Whether a shard of the job is not done: one index probe per open state."""
    return any(conn.execute(select(shards.c.id).where(shards.c.job_id == job_id, shards.c.status == st.value)
                            .limit(1)).first() is not None for st in ShardStatus if st not in SHARD_DONE)


def open_count(job_id: str, at_most: int = 1024) -> int:
    """Shards of the job that are not done, counted up to `at_most` (what keeping workers busy needs)."""
    with tx() as conn:
        sub = select(shards.c.id).where(shards.c.job_id == job_id,
                                        shards.c.status.not_in(values(SHARD_DONE))).limit(at_most).subquery()
        return int(conn.execute(select(func.count()).select_from(sub)).scalar() or 0)


def stragglers(job_id: str, factor: float, min_seconds: float) -> list[str]:
    """Running shards that deserve a speculative attempt: the job is in its tail (nothing left
    to dispatch), the shard has no twin yet, and its attempt has run longer than `min_seconds`
    and `factor` times the median execute time of committed shards in its bucket (of the whole
    job while its bucket has fewer than 3)."""
    if factor <= 0:
        return []
    t = now()
    with tx() as conn:
        if any(conn.execute(select(shards.c.id).where(shards.c.job_id == job_id, shards.c.status == st.value)
                            .limit(1)).first() is not None for st in SHARD_WAITING):
            return []
        done = conn.execute(select(shards.c.bucket, shards.c.execute_seconds).where(
            shards.c.job_id == job_id, shards.c.status == ShardStatus.COMMITTED.value,
            shards.c.execute_seconds.is_not(None))).all()
        running = conn.execute(select(shards.c.id, shards.c.bucket, attempts.c.started_at)
                               .join(attempts, and_(attempts.c.shard_id == shards.c.id,
                                                    attempts.c.number == shards.c.attempt))
                               .where(shards.c.job_id == job_id,
                                      shards.c.status == ShardStatus.RUNNING.value)).all()
        twinned = set(conn.execute(select(attempts.c.shard_id).join(shards, shards.c.id == attempts.c.shard_id)
                                   .where(shards.c.job_id == job_id, shards.c.status == ShardStatus.RUNNING.value,
                                          attempts.c.status == AttemptStatus.RUNNING.value,
                                          attempts.c.number != shards.c.attempt)).scalars())
    if len(done) < 3:
        return []

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    overall = median([d.execute_seconds for d in done])
    out = []
    for r in running:
        same = [d.execute_seconds for d in done if d.bucket == r.bucket]
        typical = median(same) if len(same) >= 3 else overall
        if r.id not in twinned and t - r.started_at > max(min_seconds, factor * typical):
            out.append(r.id)
    return out


def _unresolved_quarantined(job_id: str) -> Any:
    child = shards.alias("child")
    return (select(shards).where(
        shards.c.job_id == job_id, shards.c.status == ShardStatus.QUARANTINED.value,
        shards.c.errors_uri.is_(None), ~select(child.c.id).where(child.c.parent_id == shards.c.id).exists()))


def may_kill_its_worker(shard: Shard) -> bool:
    """Whether an earlier attempt of the shard lost its worker, or it was split from a quarantined
    shard: its records may kill their process, so a worker's lane runs it alone (`lanes.LaneGate`).
    One read, and only for a shard that was attempted before or has a parent."""
    if shard.attempt <= 1 and shard.parent_id is None:
        return False
    with tx() as conn:
        if shard.parent_id is not None and conn.execute(select(shards.c.id).where(
                shards.c.id == shard.parent_id, shards.c.status == ShardStatus.QUARANTINED.value)).first():
            return True
        return conn.execute(select(attempts.c.number).where(
            attempts.c.shard_id == shard.id, attempts.c.status == AttemptStatus.LOST.value).limit(1)).first() is not None


def unresolved_quarantined(job_id: str) -> list[Shard]:
    """Quarantined shards not yet split into children or recorded as one poison row."""
    with tx() as conn:
        return [Shard.from_row(r) for r in conn.execute(_unresolved_quarantined(job_id)).all()]


def next_ordinal(job_id: str, bucket: int) -> int:
    with tx() as conn:
        return (conn.execute(select(func.max(shards.c.ordinal)).where(
            shards.c.job_id == job_id, shards.c.bucket == bucket)).scalar() or 0) + 1


def split(parent: Shard, children: list[dict[str, Any]]) -> bool:
    """Add the child shards of a quarantined shard, once (False when they exist already)."""
    with tx() as conn:
        if conn.execute(select(shards.c.id).where(shards.c.parent_id == parent.id).limit(1)).first() is not None:
            return False
        conn.execute(insert(shards), [dict(c, job_id=parent.job_id, parent_id=parent.id, attempt=0,
                                           status=ShardStatus.PENDING.value, updated_at=now()) for c in children])
        events.record(conn, parent.job_id, "shard", parent.status, None, shard_id=parent.id,
                      detail={"split_into": [c["id"] for c in children]})
        return True


def poisoned(job_id: str, source: str, ordinal: int) -> bool:
    """Whether a piece of the record already poisoned its shard (the job holds its poison row)."""
    with tx() as conn:
        return _poisoned(conn, job_id, source, ordinal)


def _poisoned(conn: Connection, job_id: str, source: str, ordinal: int) -> bool:
    return conn.execute(select(record_errors.c.id).where(
        record_errors.c.job_id == job_id, record_errors.c.source == source, record_errors.c.ordinal == ordinal,
        record_errors.c.error == "poison").limit(1)).first() is not None


def record_poison(shard: Shard, row: dict[str, Any], errors_uri: str, errors_sha256: str, first: bool = True) -> bool:
    """A one-record quarantined shard keeps its record as one `poison` error row, once. A piece of a
    record another piece already poisoned (`first` False) resolves with an empty errors file: the
    record is one error row, not one a piece. False when the shard was resolved already, or when
    `first` no longer holds (another piece's row committed meanwhile): the next tick writes again."""
    with tx() as conn:
        conn.execute(select(jobs.c.id).where(jobs.c.id == shard.job_id).with_for_update())   # one poison row a record
        if first == _poisoned(conn, shard.job_id, row["source"], row["ordinal"]):
            return False
        done = conn.execute(update(shards).where(shards.c.id == shard.id, shards.c.errors_uri.is_(None))
                            .values(errors_uri=errors_uri, errors_sha256=errors_sha256, error_rows=int(first),
                                    output_rows=0, updated_at=now())).rowcount
        if done:
            if first:
                conn.execute(insert(record_errors).values(**bounded_error(dict(row, job_id=shard.job_id,
                                                                                  shard_id=shard.id))))
            events.record(conn, shard.job_id, "shard", shard.status, shard.status, shard_id=shard.id,
                          detail={"poison": row["record_id"], **({} if first else {"counted": False})})
        return bool(done)


def verify_when_done(job_id: str) -> bool:
    """running -> verifying once no shard is left open; True when the job moved."""
    with tx() as conn:
        if _any_open(conn, job_id):
            return False
        if conn.execute(_unresolved_quarantined(job_id).limit(1)).first() is not None:
            return False
        return transition_job(conn, job_id, JobStatus.VERIFYING)


def lease_owners(job_id: str) -> list[str]:
    """Workers holding leases on the job's running shards."""
    with tx() as conn:
        return [o for o in conn.execute(select(shards.c.lease_owner).distinct().where(
            shards.c.job_id == job_id, shards.c.status == ShardStatus.RUNNING.value)).scalars() if o]


def failed_records(job_id: str) -> int:
    """Records of the job known to have failed: every record of its validation-error shards
    (bucket < 0, planning.bucketing.ERROR_BUCKET: counted at planning, `jobs.error_records`) plus the error
    rows of the others as they commit or become poison rows (the job's tallies), so the running
    tick reads a few rows, not every shard."""
    with tx() as conn:
        planned = int(conn.execute(select(jobs.c.error_records).where(jobs.c.id == job_id)).scalar() or 0)
        return planned + tallies.read(conn, [job_id])[job_id].computed_errors
