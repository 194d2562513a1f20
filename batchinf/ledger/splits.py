"""Dynamic splitting: the lifecycle asks a running shard to split when a worker idles and nothing
is left to dispatch; the attempt holding the shard commits the records it has done (a record
boundary) and hands the rest to new pending shards, in one transaction fenced like every commit.

A split request lives on the shard (`split_requested_at`) until that attempt ends; a new attempt
starts without one. Only the holder's attempt splits (a speculative twin is superseded by the
split commit), so the parent's committed records and its children's never overlap.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError

from batchinf.ledger import events
from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.leases import commit_in
from batchinf.ledger.models import Lease, ShardResult
from batchinf.ledger.states import SHARD_WAITING, JobStatus, ShardStatus, values
from batchinf.ledger.tables import jobs, shards

SPLIT_COMMIT_TRIES = 3      # a concurrent split in the same bucket took the ordinal: try again


def request_split(job_id: str, workers: int | None, min_work: int, soon_work: int = 0) -> list[str]:
    """With `workers` in the fleet: when the job has nothing waiting to run and workers idle
    (fewer running or queued shards, over every job, than workers, less the splits already
    asked), ask that many of its running shards, those with the most remaining work (at least
    `min_work`), to split. A running shard of the job with at most `soon_work` left (its worker
    reported starting its last chunk) counts as an idle worker already: the split it gets lands
    about when that worker frees, not a chunk and a poll later. `workers` None: the caller is
    such a worker (work stealing, whatever the driver's tick) and counts only those shards,
    less the job's splits already asked. Returns the shards asked."""
    running = ShardStatus.RUNNING.value
    with tx() as conn:
        if conn.execute(select(shards.c.id).where(shards.c.job_id == job_id,
                                                  shards.c.status.in_(values(SHARD_WAITING))).limit(1)).first():
            return []
        rows = conn.execute(select(shards.c.id, shards.c.num_records, shards.c.num_tokens, shards.c.progress_records,
                                   shards.c.split_requested_at)
                            .where(shards.c.job_id == job_id, shards.c.status == running, shards.c.bucket >= 0)).all()
        left = sorted(((r.num_tokens * (r.num_records - min(r.progress_records, r.num_records)) / max(1, r.num_records),
                        r.id, r.split_requested_at is None) for r in rows), reverse=True)
        soon = sum(1 for work, _, _ in left if work <= soon_work)     # workers about to idle
        if workers is None:     # one of them asks: only they count, less the job's splits asked
            idle, soon = 0, soon - sum(1 for _, _, unasked in left if not unasked)
        else:
            busy = conn.execute(select(func.count()).select_from(shards).where(
                shards.c.status.in_([running, ShardStatus.QUEUED.value]))).scalar()
            asked = conn.execute(select(func.count()).select_from(shards).where(
                shards.c.status == running, shards.c.split_requested_at.is_not(None))).scalar()
            idle = workers - busy - asked
        free = max(0, idle)
        eligible = [(work, sid) for work, sid, unasked in left if unasked and work >= min_work]
        # an idle worker takes any split worth its fixed cost; one about to idle, only a shard
        # that is not about to finish itself
        chosen = [sid for _, sid in eligible[:free]]
        chosen += [sid for work, sid in eligible[free:] if work > soon_work][:max(0, idle + soon) - free]
        for sid in chosen:
            if conn.execute(update(shards).where(shards.c.id == sid, shards.c.status == running,
                                                 shards.c.split_requested_at.is_(None))
                            .values(split_requested_at=now())).rowcount:
                events.record(conn, job_id, "shard", running, running, shard_id=sid, detail={"split_requested": True})
        return chosen


SPLIT, STOP = "split", "stop"


def wanted(lease: Lease) -> str | None:
    """What the lifecycle wants of this attempt now: STOP when its job is no longer running (a
    cancel, a deadline: it commits what it finished and leaves the rest), SPLIT when asked to
    split (the attempt holding the shard), else None. One indexed read."""
    with tx() as conn:
        row = conn.execute(select(jobs.c.status, shards.c.split_requested_at, shards.c.attempt,
                                  shards.c.status.label("shard_status"))
                           .join(shards, shards.c.job_id == jobs.c.id)
                           .where(shards.c.id == lease.shard_id)).first()
    if row is None or row.status != JobStatus.RUNNING:
        return STOP
    asked = row.split_requested_at is not None and row.shard_status == ShardStatus.RUNNING
    return SPLIT if asked and row.attempt == lease.attempt else None


def commit_split(lease: Lease, result: ShardResult, done_records: int, done_tokens: int,
                 children: list[dict[str, Any]]) -> None:
    """The split checkpoint, in one transaction: the shard commits the `done_records` records it
    has done (`result`: a prefix of its staged records for a streaming task, any subset for
    generate; its num_records/num_tokens become theirs), fenced like `leases.commit_attempt`
    (StaleAttemptError when the attempt may no longer commit), and `children` (id, num_records,
    num_tokens, input_uri: the rest of its records, staged) become pending shards of its bucket
    with it as their parent. Coverage reads the committed parts, never the parent's staged file."""
    for attempt in range(SPLIT_COMMIT_TRIES):
        try:
            with tx() as conn:
                commit_in(conn, lease, result, num_records=done_records, num_tokens=done_tokens)
                bucket = conn.execute(select(shards.c.bucket).where(shards.c.id == lease.shard_id)).scalar()
                top = conn.execute(select(func.max(shards.c.ordinal)).where(
                    shards.c.job_id == lease.job_id, shards.c.bucket == bucket)).scalar() or 0
                t = now()
                conn.execute(insert(shards), [dict(c, job_id=lease.job_id, parent_id=lease.shard_id, bucket=bucket,
                                                   ordinal=top + 1 + k, attempt=0, status=ShardStatus.PENDING.value,
                                                   updated_at=t) for k, c in enumerate(children)])
                events.record(conn, lease.job_id, "shard", ShardStatus.COMMITTED.value, None, shard_id=lease.shard_id,
                              detail={"split_at": done_records, "split_into": [c["id"] for c in children]})
                return
        except IntegrityError:
            if attempt + 1 == SPLIT_COMMIT_TRIES:
                raise
