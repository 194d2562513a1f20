"""Ledger operations. Each public function is one transaction unless it takes a `conn`.

Invariants enforced here:
- every state change goes through `transition_job`/`transition_shard` (tables in states.py) and
  writes one `job_events` row in the same transaction;
- a shard's `attempt` column is the fencing token: only the attempt holding it may extend the
  lease or fail the shard, so a zombie attempt can never overwrite a newer one;
- a straggler may also have one speculative attempt running beside the holder; whichever of the
  two commits first wins (the commit is conditional on the shard still running and the attempt
  row still `running`), and the other is marked `superseded`, stops at its next heartbeat and
  loses its files. An attempt that is lost, failed or superseded can never commit.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any, Iterable

from sqlalchemy import Connection, and_, func, insert, select, update

from batchinf.errors import LedgerError, StaleAttemptError
from batchinf.ledger.db import tx
from batchinf.config import settings
from batchinf.ledger.states import (SHARD_DONE, AttemptStatus, JobStatus, ShardStatus, attempt_sources,
                                    job_sources, shard_sources)
from batchinf.ledger.tables import attempts, job_events, jobs, record_errors, shards


def now() -> float:
    return time.time()


def record_event(conn: Connection, job_id: str, kind: str, frm: str | None, to: str | None,
           shard_id: str | None = None, detail: Any = None) -> None:
    if detail is not None and not isinstance(detail, str):
        detail = json.dumps(detail, default=str)
    conn.execute(insert(job_events).values(job_id=job_id, shard_id=shard_id, kind=kind,
                                           from_status=frm, to_status=to, detail=detail, at=now()))


def transition_job(conn: Connection, job_id: str, to: JobStatus, *, detail: Any = None,
                   **fields: Any) -> bool:
    """Move a job to `to` if the state table allows it from its current state. False if not."""
    frm = conn.execute(select(jobs.c.status).where(jobs.c.id == job_id)).scalar()
    if frm is None:
        raise LedgerError(f"no job {job_id!r}")
    res = conn.execute(update(jobs)
                       .where(jobs.c.id == job_id, jobs.c.status.in_(job_sources(to)))
                       .values(status=to.value, updated_at=now(), **fields))
    if res.rowcount != 1:
        return False
    record_event(conn, job_id, "job", frm, to.value, detail=detail)
    return True


def transition_shard(conn: Connection, shard_id: str, to: ShardStatus, *, fence: int | None = None,
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
    res = conn.execute(update(shards).where(*cond).values(status=to.value, updated_at=now(), **fields))
    if res.rowcount != 1:
        return False
    record_event(conn, row.job_id, "shard", row.status, to.value, shard_id=shard_id, detail=detail)
    return True


def end_attempt(conn: Connection, shard_id: str, number: int | None, to: AttemptStatus, **fields: Any) -> int:
    """Move attempt `number` of the shard (every attempt when None) to `to`, from the states
    ATTEMPT_TRANSITIONS allows; returns how many moved. A finished attempt never changes outcome."""
    cond = [attempts.c.shard_id == shard_id, attempts.c.status.in_(attempt_sources(to))]
    if number is not None:
        cond.append(attempts.c.number == number)
    if to is not AttemptStatus.SWEPT:
        fields.setdefault("finished_at", now())
    return conn.execute(update(attempts).where(*cond).values(status=to.value, **fields)).rowcount


def require_job_transition(job_id: str, to: JobStatus, **fields: Any) -> None:
    with tx() as conn:
        if not transition_job(conn, job_id, to, **fields):
            status = conn.execute(select(jobs.c.status).where(jobs.c.id == job_id)).scalar()
            raise LedgerError(f"job {job_id} cannot go from {status} to {to.value}")


def fail_job(job_id: str, reason: str) -> bool:
    with tx() as conn:
        return transition_job(conn, job_id, JobStatus.FAILED, detail=reason, error=reason,
                              finished_at=now())


@dataclass(frozen=True)
class Lease:
    shard_id: str
    job_id: str
    attempt: int          # fencing token
    worker: str


def _next_attempt(shard_id: str) -> Any:
    """max(attempt number) + 1 over every attempt of the shard, speculative ones included."""
    return (select(func.coalesce(func.max(attempts.c.number), 0) + 1)
            .where(attempts.c.shard_id == shard_id).scalar_subquery())


def _take(conn: Connection, shard_id: str, job_id: str, worker: str, lease_seconds: float) -> Lease | None:
    t = now()
    res = conn.execute(update(shards)
                       .where(shards.c.id == shard_id, shards.c.status == ShardStatus.QUEUED.value)
                       .values(status=ShardStatus.RUNNING.value, attempt=_next_attempt(shard_id),
                               lease_owner=worker, lease_expires_at=t + lease_seconds, updated_at=t)
                       .returning(shards.c.attempt))
    number = res.scalar()
    if number is None:
        return None
    conn.execute(insert(attempts).values(shard_id=shard_id, number=number, worker=worker,
                                         status="running", started_at=t, heartbeat_at=t))
    record_event(conn, job_id, "shard", ShardStatus.QUEUED.value, ShardStatus.RUNNING.value,
           shard_id=shard_id, detail={"attempt": number, "worker": worker})
    return Lease(shard_id, job_id, number, worker)


def claim_next(job_ids: Iterable[str] | None, worker: str, lease_seconds: float) -> Lease | None:
    """Lease the next queued shard (of the given jobs, or any running job), highest priority first."""
    with tx() as conn:
        q = (select(shards.c.id, shards.c.job_id).join(jobs, jobs.c.id == shards.c.job_id)
             .where(shards.c.status == ShardStatus.QUEUED.value,
                    jobs.c.status == JobStatus.RUNNING.value)
             .order_by(jobs.c.priority.desc(), jobs.c.created_at, shards.c.bucket.desc(),
                       shards.c.ordinal)
             .limit(1))
        if job_ids is not None:
            q = q.where(shards.c.job_id.in_(list(job_ids)))
        if conn.dialect.name == "postgresql":
            q = q.with_for_update(of=shards, skip_locked=True)
        row = conn.execute(q).first()
        return _take(conn, row.id, row.job_id, worker, lease_seconds) if row else None


def claim_shard(shard_id: str, worker: str, lease_seconds: float) -> Lease | None:
    """Lease one named shard; None when it is not queued (duplicate delivery, already leased or
    committed) or its job is not running."""
    with tx() as conn:
        q = (select(shards.c.id, shards.c.job_id).join(jobs, jobs.c.id == shards.c.job_id)
             .where(shards.c.id == shard_id, shards.c.status == ShardStatus.QUEUED.value,
                    jobs.c.status == JobStatus.RUNNING.value))
        if conn.dialect.name == "postgresql":
            q = q.with_for_update(of=shards, skip_locked=True)
        row = conn.execute(q).first()
        return _take(conn, row.id, row.job_id, worker, lease_seconds) if row else None


def _live(lease: Lease) -> Any:
    """SQL condition: the shard is still running and this attempt may still commit it."""
    return and_(shards.c.id == lease.shard_id, shards.c.status == ShardStatus.RUNNING.value,
                select(attempts.c.number).where(
                    attempts.c.shard_id == lease.shard_id, attempts.c.number == lease.attempt,
                    attempts.c.status == AttemptStatus.RUNNING.value).exists())


def heartbeat(lease: Lease, lease_seconds: float) -> bool:
    """Extend the lease; False when the attempt can no longer commit (fenced off, superseded,
    or its job stopped): the worker then stops working on it."""
    t = now()
    with tx() as conn:
        if conn.execute(select(jobs.c.status).where(jobs.c.id == lease.job_id)).scalar() != JobStatus.RUNNING:
            return False
        if conn.execute(select(shards.c.id).where(_live(lease))).first() is None:
            return False
        conn.execute(update(shards).where(shards.c.id == lease.shard_id, shards.c.attempt == lease.attempt)
                     .values(lease_expires_at=t + lease_seconds))
        conn.execute(update(attempts)
                     .where(attempts.c.shard_id == lease.shard_id, attempts.c.number == lease.attempt)
                     .values(heartbeat_at=t))
        return True


@dataclass(frozen=True)
class ShardResult:
    output_uri: str
    output_sha256: str
    output_rows: int
    errors_uri: str
    errors_sha256: str
    error_rows: int
    tokens_input: int
    tokens_output: int
    tokens_real: int
    tokens_padded: int
    execute_seconds: float
    errors: list[dict]    # record error rows: record_id, source, ordinal, error, message, attempts


def commit_attempt(lease: Lease, result: ShardResult) -> None:
    """Checkpoint: the shard becomes committed with this attempt's outputs, in one transaction,
    only if the attempt may still commit it (see `_live`) and the job is still running (so
    nothing commits after a cancel or deadline). The winner becomes the fencing token; a
    speculative twin still running is superseded. Raises StaleAttemptError otherwise."""
    with tx() as conn:
        q = select(jobs.c.status).where(jobs.c.id == lease.job_id)
        if conn.dialect.name == "postgresql":
            q = q.with_for_update()      # serializes with the job's cancel/expire transition
        if conn.execute(q).scalar() != JobStatus.RUNNING:
            raise StaleAttemptError(f"job {lease.job_id} is no longer running; attempt {lease.attempt} "
                                    f"of shard {lease.shard_id} is discarded")
        ok = transition_shard(
            conn, lease.shard_id, ShardStatus.COMMITTED, where=_live(lease),
            detail={"attempt": lease.attempt, "rows": result.output_rows, "errors": result.error_rows},
            attempt=lease.attempt, lease_owner=None, lease_expires_at=None, last_error=None,
            output_uri=result.output_uri, output_sha256=result.output_sha256,
            output_rows=result.output_rows, errors_uri=result.errors_uri,
            errors_sha256=result.errors_sha256, error_rows=result.error_rows,
            tokens_input=result.tokens_input, tokens_output=result.tokens_output,
            tokens_real=result.tokens_real, tokens_padded=result.tokens_padded,
            execute_seconds=result.execute_seconds)
        if not ok:
            raise StaleAttemptError(f"attempt {lease.attempt} of shard {lease.shard_id} lost its lease; "
                                    "another attempt owns the shard")
        end_attempt(conn, lease.shard_id, lease.attempt, AttemptStatus.COMMITTED)
        end_attempt(conn, lease.shard_id, None, AttemptStatus.SUPERSEDED,   # a twin lost the race
                    error=f"attempt {lease.attempt} committed first")
        if result.errors:
            conn.execute(insert(record_errors),
                         [dict(e, job_id=lease.job_id, shard_id=lease.shard_id) for e in result.errors])


def backoff(attempt: int, base: float = 1.0, cap: float = 30.0) -> float:
    """Capped exponential backoff with full jitter."""
    return random.uniform(0, min(cap, base * 2 ** max(0, attempt - 1)))


def _retry_or_fail(conn: Connection, shard_id: str, attempt: int, error: str, max_attempts: int,
                   attempt_status: AttemptStatus) -> ShardStatus | None:
    """Out of attempts, a shard whose every attempt lost its worker is quarantined (a record in
    it kills workers); one whose attempts raised fails, and fails its job. A speculative attempt
    that fails or is lost just ends: the attempt holding the shard carries on."""
    target = ShardStatus.RETRYING
    job_id, holder = conn.execute(select(shards.c.job_id, shards.c.attempt).where(shards.c.id == shard_id)).one()
    if holder != attempt:
        end_attempt(conn, shard_id, attempt, attempt_status, error=error[:4000])
        return None
    if attempt_status == AttemptStatus.FAILED:
        record_event(conn, job_id, "attempt", AttemptStatus.RUNNING.value, AttemptStatus.FAILED.value,
                     shard_id=shard_id, detail={"attempt": attempt, "error": error[:500]})
    if attempt_status == AttemptStatus.FAILED and _job_retry_budget_spent(conn, job_id):
        error = (f"the job's retry budget is spent ({_job_retry_budget(conn, job_id)} failed "
                 f"attempts; set BATCHINF_JOB_RETRY_BUDGET to allow more); last error: {error}")
        max_attempts = 0
    if attempt >= max_attempts:
        others = conn.execute(select(attempts.c.status).where(
            attempts.c.shard_id == shard_id, attempts.c.number != attempt)).scalars().all()
        killed = attempt_status == AttemptStatus.LOST and all(
            s in (AttemptStatus.LOST, AttemptStatus.SWEPT, AttemptStatus.SUPERSEDED) for s in others)
        target = ShardStatus.QUARANTINED if killed else ShardStatus.FAILED
    ok = transition_shard(conn, shard_id, target, fence=attempt,
                          detail={"attempt": attempt, "error": error[:2000]},
                          lease_owner=None, lease_expires_at=None, last_error=error[:4000],
                          not_before=now() + backoff(attempt))
    if not ok:
        return None
    end_attempt(conn, shard_id, attempt, attempt_status, error=error[:4000])
    if target is ShardStatus.FAILED:
        reason = (f"shard {shard_id} failed {attempt} attempts; last error: {error[:1000]}")
        transition_job(conn, job_id, JobStatus.FAILED, detail=reason, error=reason, finished_at=now())
    return target


def _job_retry_budget(conn: Connection, job_id: str) -> int:
    budget = settings().job_retry_budget
    if budget <= 0:
        n = conn.execute(select(func.count()).select_from(shards).where(shards.c.job_id == job_id)).scalar()
        budget = max(10, n)
    return budget


def _job_retry_budget_spent(conn: Connection, job_id: str) -> bool:
    """Attempts that raised, across the job: a storage outage fails the job after a bounded number
    of retries instead of every shard retrying against it (a retry storm)."""
    failed = conn.execute(select(func.count()).select_from(job_events).where(
        job_events.c.job_id == job_id, job_events.c.kind == "attempt",
        job_events.c.to_status == AttemptStatus.FAILED.value)).scalar()
    return failed > _job_retry_budget(conn, job_id)


def fail_attempt(lease: Lease, error: str, max_attempts: int) -> ShardStatus | None:
    """The attempt failed: retry later, or fail the shard (and its job) when attempts run out."""
    with tx() as conn:
        return _retry_or_fail(conn, lease.shard_id, lease.attempt, error, max_attempts, AttemptStatus.FAILED)


def expire_leases(job_id: str | None, max_attempts: int, *, dead_owners: Iterable[str] = ()) -> int:
    """Running shards whose lease expired (or whose owner is known dead) go to retrying, unless a
    live speculative attempt runs beside the lost one: that attempt then holds the shard. Silent
    speculative attempts are marked lost."""
    t = now()
    dead = list(dead_owners)
    lease_seconds = settings().lease_seconds
    with tx() as conn:
        cond = [shards.c.status == ShardStatus.RUNNING.value]
        if job_id is not None:
            cond.append(shards.c.job_id == job_id)
        silent = (attempts.c.heartbeat_at < t - lease_seconds)
        if dead:
            silent = silent | attempts.c.worker.in_(dead)
        twins = conn.execute(select(attempts.c.shard_id, attempts.c.number, attempts.c.worker)
                             .join(shards, shards.c.id == attempts.c.shard_id)
                             .where(*cond, attempts.c.status == AttemptStatus.RUNNING.value,
                                    attempts.c.number != shards.c.attempt, silent)).all()
        for r in twins:
            _retry_or_fail(conn, r.shard_id, r.number, f"lease lost (speculative attempt on {r.worker} "
                           "stopped heartbeating)", max_attempts, AttemptStatus.LOST)
        expired = shards.c.lease_expires_at < t
        if dead:
            expired = expired | shards.c.lease_owner.in_(dead)
        rows = conn.execute(select(shards.c.id, shards.c.job_id, shards.c.attempt, shards.c.lease_owner)
                            .where(*cond, expired)).all()
        for r in rows:
            error = f"lease lost (worker {r.lease_owner} stopped heartbeating)"
            twin = conn.execute(select(attempts.c.number, attempts.c.worker, attempts.c.heartbeat_at).where(
                attempts.c.shard_id == r.id, attempts.c.number != r.attempt,
                attempts.c.status == AttemptStatus.RUNNING.value)).first()
            if twin is None:
                _retry_or_fail(conn, r.id, r.attempt, error, max_attempts, AttemptStatus.LOST)
                continue
            end_attempt(conn, r.id, r.attempt, AttemptStatus.LOST, error=error)
            conn.execute(update(shards).where(shards.c.id == r.id, shards.c.attempt == r.attempt).values(
                attempt=twin.number, lease_owner=twin.worker,
                lease_expires_at=(twin.heartbeat_at or t) + lease_seconds, updated_at=t))
            record_event(conn, r.job_id, "attempt", AttemptStatus.RUNNING.value, AttemptStatus.LOST.value,
                         shard_id=r.id, detail={"attempt": r.attempt, "error": error,
                                                "holder_now": twin.number})
    return len(rows)


def stragglers(job_id: str, factor: float, min_seconds: float) -> list[str]:
    """Running shards that deserve a speculative attempt: the job is in its tail (nothing left
    to dispatch), the shard has no twin yet, and its attempt has run longer than `min_seconds`
    and `factor` times the median execute time of committed shards in its bucket (of the whole
    job while its bucket has fewer than 3)."""
    if factor <= 0:
        return []
    t = now()
    with tx() as conn:
        counts = shard_counts(conn, job_id)
        if any(counts.get(s, 0) for s in (ShardStatus.PENDING, ShardStatus.QUEUED, ShardStatus.RETRYING)):
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
        xs = sorted(xs)
        return xs[len(xs) // 2]

    overall = median([d.execute_seconds for d in done])
    out = []
    for r in running:
        same = [d.execute_seconds for d in done if d.bucket == r.bucket]
        typical = median(same) if len(same) >= 3 else overall
        if r.id not in twinned and t - r.started_at > max(min_seconds, factor * typical):
            out.append(r.id)
    return out


def claim_speculative(shard_id: str, worker: str) -> Lease | None:
    """Start a speculative attempt beside the running one, on another worker; None when the
    shard is not running, already has a twin, or `worker` is the one running it."""
    with tx() as conn:
        q = (select(shards.c.job_id).join(jobs, jobs.c.id == shards.c.job_id)
             .where(shards.c.id == shard_id, shards.c.status == ShardStatus.RUNNING.value,
                    jobs.c.status == JobStatus.RUNNING.value))
        if conn.dialect.name == "postgresql":
            q = q.with_for_update(of=shards)
        job_id = conn.execute(q).scalar()
        if job_id is None:
            return None
        live = conn.execute(select(attempts.c.worker).where(
            attempts.c.shard_id == shard_id, attempts.c.status == AttemptStatus.RUNNING.value)).scalars().all()
        if len(live) != 1 or live[0] == worker:
            return None
        number = conn.execute(select(_next_attempt(shard_id))).scalar()
        t = now()
        conn.execute(insert(attempts).values(shard_id=shard_id, number=number, worker=worker,
                                             status=AttemptStatus.RUNNING.value, started_at=t, heartbeat_at=t))
        record_event(conn, job_id, "attempt", None, AttemptStatus.RUNNING.value, shard_id=shard_id,
                     detail={"attempt": number, "worker": worker, "speculative": True})
        return Lease(shard_id, job_id, number, worker)


def dispatch_ready(job_id: str, limit: int | None = None) -> list[str]:
    """pending and retrying-past-backoff shards become queued; returns their ids (bounded by limit)."""
    t = now()
    with tx() as conn:
        q = (select(shards.c.id, shards.c.status).where(
            shards.c.job_id == job_id,
            (shards.c.status == ShardStatus.PENDING.value)
            | and_(shards.c.status == ShardStatus.RETRYING.value,
                   func.coalesce(shards.c.not_before, 0) <= t))
             .order_by(shards.c.bucket.desc(), shards.c.ordinal))
        if limit is not None:
            q = q.limit(limit)
        ids = []
        for r in conn.execute(q).all():
            if transition_shard(conn, r.id, ShardStatus.QUEUED):
                ids.append(r.id)
    return ids


@dataclass(frozen=True)
class Demand:
    """A running job's claim on dispatch slots (see controller.share_slots)."""
    job_id: str
    priority: int
    deadline_at: float | None
    created_at: float
    in_flight: int        # queued or running shards
    ready: int            # shards that could be queued now


UNPLANNED_DEMAND = 1 << 30   # a job still planning claims every slot it outranks: kept free for it


def dispatch_demand() -> list[Demand]:
    """Each active job's slots in use and shards ready to dispatch. A job still being planned
    counts as wanting every slot, so lower-priority jobs do not fill the fleet meanwhile."""
    t = now()
    ready = ((shards.c.status == ShardStatus.PENDING.value)
             | and_(shards.c.status == ShardStatus.RETRYING.value, func.coalesce(shards.c.not_before, 0) <= t))
    flying = shards.c.status.in_([ShardStatus.QUEUED.value, ShardStatus.RUNNING.value])
    planning = [JobStatus.SUBMITTED.value, JobStatus.PLANNING.value]
    with tx() as conn:
        rows = conn.execute(
            select(jobs.c.id, jobs.c.status, jobs.c.priority, jobs.c.deadline_at, jobs.c.created_at,
                   func.count(shards.c.id).filter(flying).label("in_flight"),
                   func.count(shards.c.id).filter(ready).label("ready"))
            .outerjoin(shards, shards.c.job_id == jobs.c.id)
            .where(jobs.c.status.in_([JobStatus.RUNNING.value, *planning]))
            .group_by(jobs.c.id, jobs.c.status, jobs.c.priority, jobs.c.deadline_at, jobs.c.created_at)).all()
    return [Demand(r.id, r.priority, r.deadline_at, r.created_at, r.in_flight,
                   UNPLANNED_DEMAND if r.status in planning else r.ready) for r in rows]


def shard_counts(conn: Connection, job_id: str) -> dict[str, int]:
    rows = conn.execute(select(shards.c.status, func.count()).where(shards.c.job_id == job_id)
                        .group_by(shards.c.status)).all()
    return {status: n for status, n in rows}


def lock_job(job_id: str, owner: str, seconds: float) -> bool:
    """Take (or extend) the controller lease on a job: two controllers never step one job at once."""
    t = now()
    with tx() as conn:
        res = conn.execute(update(jobs).where(
            jobs.c.id == job_id,
            (jobs.c.lock_owner.is_(None)) | (jobs.c.lock_owner == owner) | (jobs.c.lock_expires_at < t))
            .values(lock_owner=owner, lock_expires_at=t + seconds))
        return res.rowcount == 1


def unlock_job(job_id: str, owner: str) -> None:
    with tx() as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.lock_owner == owner)
                     .values(lock_owner=None, lock_expires_at=None))


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


def verify_when_done(job_id: str) -> bool:
    """running -> verifying once no shard is left open; True when the job moved."""
    child = shards.alias("child")
    with tx() as conn:
        counts = shard_counts(conn, job_id)
        if any(n for st, n in counts.items() if st not in SHARD_DONE):
            return False
        unresolved = conn.execute(select(shards.c.id).where(     # quarantined, not yet split/recorded
            shards.c.job_id == job_id, shards.c.status == ShardStatus.QUARANTINED.value,
            shards.c.errors_uri.is_(None),
            ~select(child.c.id).where(child.c.parent_id == shards.c.id).exists())).first()
        return unresolved is None and transition_job(conn, job_id, JobStatus.VERIFYING)


def request_cancel(job_id: str, reason: str) -> bool:
    """Any active job -> cancelling. Dispatch stops, running attempts stop at their next
    heartbeat, nothing commits any more; the driver or controller then writes _PARTIAL.json."""
    with tx() as conn:
        return transition_job(conn, job_id, JobStatus.CANCELLING, detail=reason, error=reason)


def cancel_if_past_deadline(job_id: str) -> bool:
    with tx() as conn:
        deadline = conn.execute(select(jobs.c.deadline_at).where(jobs.c.id == job_id)).scalar()
    if deadline is None or deadline > now():
        return False
    return request_cancel(job_id, "deadline passed before the job completed")


def release_leases(job_id: str) -> None:
    """A stopped job's running shards give up their leases (their attempts are lost)."""
    with tx() as conn:
        rows = conn.execute(select(attempts.c.shard_id, attempts.c.number)
                            .join(shards, shards.c.id == attempts.c.shard_id)
                            .where(shards.c.job_id == job_id, shards.c.status == ShardStatus.RUNNING.value,
                                   attempts.c.status == AttemptStatus.RUNNING.value)
                            .order_by(attempts.c.number.desc())).all()   # twins before holders
        for r in rows:
            _retry_or_fail(conn, r.shard_id, r.number, "job stopped", max_attempts=r.number + 1,
                           attempt_status=AttemptStatus.LOST)


def leases_held(job_id: str) -> int:
    """Running shards of the job whose lease has not expired yet."""
    with tx() as conn:
        return conn.execute(select(func.count()).select_from(shards).where(
            shards.c.job_id == job_id, shards.c.status == ShardStatus.RUNNING.value,
            shards.c.lease_expires_at >= now())).scalar()
