"""The attempt repository: outcomes of attempts (over ATTEMPT_TRANSITIONS) and sweeping losers."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, func, select, update

from batchinf.engines import ANY, Route
from batchinf.ledger import events
from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.states import ATTEMPT_LOSERS, SHARD_DONE, AttemptStatus, attempt_sources, values
from batchinf.ledger.tables import attempts, jobs, shards
from batchinf.phases import AttemptSpan


def end_attempt(conn: Connection, shard_id: str, number: int | None, to: AttemptStatus, *,
                detail: dict[str, Any] | None = None, **fields: Any) -> int:
    """Move attempt `number` of the shard (every attempt when None) to `to`, from the states
    ATTEMPT_TRANSITIONS allows; returns how many moved. A finished attempt never changes outcome.
    Each move writes an `attempt` event, except the winner's: the shard's `committed` event
    records it with its attempt number."""
    cond = [attempts.c.shard_id == shard_id, attempts.c.status.in_(attempt_sources(to))]
    if number is not None:
        cond.append(attempts.c.number == number)
    moving = conn.execute(select(attempts.c.number, attempts.c.status).where(*cond)).all()
    if not moving:
        return 0
    if to is not AttemptStatus.SWEPT:
        fields.setdefault("finished_at", now())
    conn.execute(update(attempts).where(*cond).values(status=to.value, **fields))
    if to is not AttemptStatus.COMMITTED:
        job_id = conn.execute(select(shards.c.job_id).where(shards.c.id == shard_id)).scalar()
        for n, frm in moving:
            info = {"attempt": n, **({"error": str(fields["error"])[:500]} if fields.get("error") else {}),
                    **(detail or {})}
            events.record(conn, job_id, "attempt", frm, to.value, shard_id=shard_id, detail=info)
    return len(moving)


def losers(job_id: str) -> list[tuple[str, int]]:
    """(shard, attempt) of attempts that lost (failed, lost to a dead or stalled worker,
    superseded) on shards that are done (committed, or quarantined and split): no attempt of those
    can commit any more, and no zombie is still allowed to write their files."""
    with tx() as conn:
        return [tuple(r) for r in conn.execute(
            select(attempts.c.shard_id, attempts.c.number).join(shards, shards.c.id == attempts.c.shard_id)
            .where(shards.c.job_id == job_id, shards.c.status.in_(values(SHARD_DONE)),
                   attempts.c.status.in_(values(ATTEMPT_LOSERS)))).all()]


def swept(shard_id: str, number: int) -> None:
    """The attempt's files are deleted."""
    with tx() as conn:
        end_attempt(conn, shard_id, number, AttemptStatus.SWEPT)


def recent_workers(seconds: float, route: Route | None = None) -> int:
    """Distinct workers that started or heartbeated an attempt in the last `seconds`: the live
    fleet as the ledger sees it; with `route`, of jobs on its engine (and its device, unless any)."""
    t = now() - seconds
    q = select(func.count(attempts.c.worker.distinct())).where(
        func.coalesce(attempts.c.heartbeat_at, attempts.c.started_at) >= t)
    if route is not None:
        q = q.join(shards, shards.c.id == attempts.c.shard_id).join(jobs, jobs.c.id == shards.c.job_id) \
            .where(jobs.c.engine == route.engine)
        if route.device != ANY:
            q = q.where(jobs.c.device == route.device)
    with tx() as conn:
        return int(conn.execute(q).scalar() or 0)


def spans(job_id: str) -> list[AttemptSpan]:
    """Every attempt of the job's shards: (worker, started_at, finished_at, load_seconds), for its
    phases (batchinf/phases.py) when it is published: one statement, once per job."""
    with tx() as conn:
        rows = conn.execute(select(attempts.c.worker, attempts.c.started_at, attempts.c.finished_at,
                                   attempts.c.load_seconds).join(shards, shards.c.id == attempts.c.shard_id)
                            .where(shards.c.job_id == job_id)).all()
    return [AttemptSpan(*r) for r in rows]
