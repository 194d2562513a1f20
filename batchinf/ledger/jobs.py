"""The job repository: every read and write of `jobs` and `job_inputs`. Each public function is
one transaction unless it takes a `conn`; reads return `Job` / `InputObject`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable

from sqlalchemy import Connection, bindparam, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from batchinf.errors import LedgerError
from batchinf.ledger import events
from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.models import InputObject, Job, bounded_error
from batchinf.ledger.states import JOB_ACTIVE, JOB_TERMINAL, SHARD_DONE, JobStatus, job_sources, values
from batchinf.ledger.tables import job_events, job_inputs, jobs, record_errors, retry_records, shards
from batchinf.store import ObjectPin


def transition(conn: Connection, job_id: str, to: JobStatus, *, detail: Any = None, reopen: bool = False,
               phases: dict[str, Any] | None = None, **fields: Any) -> bool:
    """Move a job to `to` if the state table (with `reopen`, `JOB_REOPENINGS` too) allows it from
    its current state; False if not. The move's time joins the job's phase marks (`phases.at`,
    batchinf/phases.py), and `phases` with them, in the same statement."""
    found = conn.execute(select(jobs.c.status, jobs.c.phases).where(jobs.c.id == job_id)).first()
    if found is None:
        raise LedgerError(f"no job {job_id!r}")
    t = now()
    res = conn.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.status.in_(job_sources(to, reopen=reopen)))
                       .values(status=to.value, updated_at=t, phases=_marked(found.phases, to, t, phases), **fields))
    if res.rowcount != 1:
        return False
    events.record(conn, job_id, "job", found.status, to.value, detail=detail)
    return True


def _marked(stored: str | None, to: JobStatus, t: float, more: dict[str, Any] | None) -> str:
    """The job's phase marks (JSON) with its move to `to` at `t`, and `more`; a job that moves on
    from a terminal state (published again) drops the phases computed when it ended."""
    marks = json.loads(stored or "{}")
    marks.setdefault("at", {})[to.value] = t
    if to not in JOB_TERMINAL:
        marks.pop("final", None)
    marks.update(more or {})
    return json.dumps(marks)


def note_workers(job_id: str, workers: dict[str, dict[str, float]]) -> None:
    """An embedded driver's worker processes, by worker name: when each was spawned, ready (its
    imports done) and had its job's bundle loaded (`WorkerPool.reports`), added to the job's
    phase marks. One transaction per batch of reports: a few per job."""
    with tx() as conn:
        marks = json.loads(conn.execute(select(jobs.c.phases).where(jobs.c.id == job_id)).scalar() or "{}")
        for name, times in workers.items():
            marks.setdefault("workers", {}).setdefault(name, {}).update(times)
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(phases=json.dumps(marks)))


def move(job_id: str, to: JobStatus, *, detail: Any = None, errors: list[dict[str, Any]] | None = None,
         **fields: Any) -> bool:
    """`transition` in a transaction of its own; when it moves the job, `errors` (error rows with
    their `shard_id`: those publish assembled for records staged in pieces, which no shard
    committed as rows) join the job's record errors in the same transaction, so once."""
    with tx() as conn:
        moved = transition(conn, job_id, to, detail=detail, **fields)
        if moved and errors:
            conn.execute(insert(record_errors), [bounded_error(dict(e, job_id=job_id)) for e in errors])
        return moved


def fail(job_id: str, reason: str) -> bool:
    return move(job_id, JobStatus.FAILED, detail=reason, error=reason, finished_at=now())


def reopen_for_publish(job_id: str) -> bool:
    """failed -> verifying (`JOB_REOPENINGS`), for `batchinf verify --publish`: only a job whose
    failing transition left `verifying` (it failed in verification or publishing) and whose shards
    are all done. False when the job is not failed; LedgerError naming the reason and the fix when
    it may not be reopened."""
    with tx() as conn:
        status = conn.execute(select(jobs.c.status).where(jobs.c.id == job_id)).scalar()
        if status is None:
            raise LedgerError(f"no job {job_id!r}; see `batchinf jobs`")
        if status != JobStatus.FAILED:
            return False
        left = conn.execute(select(job_events.c.from_status).where(
            job_events.c.job_id == job_id, job_events.c.kind == "job", job_events.c.to_status == JobStatus.FAILED.value)
            .order_by(job_events.c.id.desc()).limit(1)).scalar()
        if left != JobStatus.VERIFYING:
            raise LedgerError(f"job {job_id} failed while {left}, not in verification, so it has nothing to publish: "
                              f"run it again (`batchinf retry {job_id} --not-done`, or submit it anew)")
        open_ = conn.execute(select(shards.c.id).where(shards.c.job_id == job_id,
                                                       shards.c.status.not_in(values(SHARD_DONE))).limit(1)).scalar()
        if open_ is not None:
            raise LedgerError(f"job {job_id}: shard {open_} is not committed, so the job cannot be published; "
                              f"run it again with `batchinf retry {job_id} --not-done`")
        return transition(conn, job_id, JobStatus.VERIFYING, reopen=True, detail="verify --publish: publish again",
                          error=None, finished_at=None, step_failures=0)


def request_cancel(job_id: str, reason: str) -> bool:
    """Any active job -> cancelling. Dispatch stops, running attempts stop at their next batch
    and commit what they finished (`execute.Watch`); once none holds a lease the driver running
    the job writes _PARTIAL.json, and nothing commits any more."""
    return move(job_id, JobStatus.CANCELLING, detail=reason, error=reason)


DEADLINE_PASSED = "deadline passed before the job completed"


def cancel_if_past_deadline(job: Job) -> Job:
    """The job, cancelling if its deadline passed (as `request_cancel` left it), else as it is."""
    if job.deadline_at is None or job.deadline_at > now() or not request_cancel(job.id, DEADLINE_PASSED):
        return job
    return dataclasses.replace(job, status=JobStatus.CANCELLING.value, error=DEADLINE_PASSED)


def create(values: dict[str, Any], selection: list[tuple[str, int]] | None = None) -> tuple[str, bool]:
    """Insert a submitted job; (id, True), or (the existing job's id, False) when its
    (tenant, idempotency_key) was taken meanwhile. `selection`: the only records (source uri,
    ordinal) a retry job plans, stored in the same transaction."""
    try:
        with tx() as conn:
            conn.execute(insert(jobs).values(status=JobStatus.SUBMITTED.value, **values))
            if selection:
                conn.execute(insert(retry_records), [{"job_id": values["id"], "source": src, "ordinal": o}
                                                     for src, o in selection])
    except IntegrityError:
        existing = find_by_key(values["tenant"], values["idempotency_key"])
        if existing:
            return existing, False
        raise
    return values["id"], True


def row(job_id: str, *, tenant: str | None = None) -> Any:
    """The job's row (for the status model's aggregates); with `tenant`, another tenant's job is
    as missing as a missing one."""
    q = select(jobs).where(jobs.c.id == job_id)
    if tenant is not None:
        q = q.where(jobs.c.tenant == tenant)
    with tx() as conn:
        found = conn.execute(q).first()
    if found is None:
        raise LedgerError(f"no job {job_id!r}; see `batchinf jobs`")
    return found


def get(job_id: str, *, tenant: str | None = None) -> Job:
    return Job.from_row(row(job_id, tenant=tenant))


def status_of(job_id: str) -> str:
    """The job's status alone (one column of its row: no manifest to parse)."""
    with tx() as conn:
        found = conn.execute(select(jobs.c.status).where(jobs.c.id == job_id)).scalar()
    if found is None:
        raise LedgerError(f"no job {job_id!r}; see `batchinf jobs`")
    return found


def stored_manifest(job_id: str) -> dict[str, Any]:
    """The job's manifest exactly as stored at submit (JSON), for comparing with a new one."""
    with tx() as conn:
        return json.loads(conn.execute(select(jobs.c.manifest).where(jobs.c.id == job_id)).scalar() or "{}")


def find_by_key(tenant: str, key: str) -> str | None:
    with tx() as conn:
        return conn.execute(select(jobs.c.id).where(jobs.c.tenant == tenant,
                                                    jobs.c.idempotency_key == key)).scalar()


def active_ids() -> list[str]:
    """Active jobs, highest priority first, then oldest."""
    with tx() as conn:
        return conn.execute(select(jobs.c.id).where(jobs.c.status.in_(values(JOB_ACTIVE)))
                            .order_by(jobs.c.priority.desc(), jobs.c.created_at)).scalars().all()


def lock(job_id: str, owner: str, seconds: float) -> bool:
    """Take (or extend) the controller lease on a job: two controllers never step one job at once."""
    t = now()
    with tx() as conn:
        return conn.execute(update(jobs).where(
            jobs.c.id == job_id,
            (jobs.c.lock_owner.is_(None)) | (jobs.c.lock_owner == owner) | (jobs.c.lock_expires_at < t))
            .values(lock_owner=owner, lock_expires_at=t + seconds)).rowcount == 1


def step_failed(job_id: str) -> int:
    """Count one more consecutive failed lifecycle step of the job; returns the count."""
    with tx() as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(step_failures=jobs.c.step_failures + 1))
        return conn.execute(select(jobs.c.step_failures).where(jobs.c.id == job_id)).scalar() or 0


def step_succeeded(job_id: str) -> None:
    with tx() as conn:
        conn.execute(update(jobs).where(jobs.c.id == job_id, jobs.c.step_failures > 0).values(step_failures=0))


# --- inputs and planning -------------------------------------------------------------------------


def pin(job_id: str, pins: list[ObjectPin]) -> bool:
    """submitted -> planning with the pinned objects, in one transaction (a second pinner changes
    nothing)."""
    with tx() as conn:
        if not transition(conn, job_id, JobStatus.PLANNING, detail={"objects": len(pins)}, started_at=now()):
            return False
        conn.execute(insert(job_inputs), [
            {"job_id": job_id, "idx": i, "uri": p.uri, "size": p.size, "etag": p.etag,
             "version_id": p.version_id} for i, p in enumerate(pins)])
        return True


def inputs(job_id: str) -> list[InputObject]:
    with tx() as conn:
        rows = conn.execute(select(job_inputs).where(job_inputs.c.job_id == job_id)
                            .order_by(job_inputs.c.idx)).all()
    return [InputObject.from_row(r) for r in rows]


def input_object(job_id: str, idx: int) -> InputObject:
    """One pinned input object of the job (a planning task reads its own, not every object's)."""
    with tx() as conn:
        r = conn.execute(select(job_inputs).where(job_inputs.c.job_id == job_id, job_inputs.c.idx == idx)).first()
    if r is None:
        raise LedgerError(f"job {job_id} has no input object {idx}")
    return InputObject.from_row(r)


def plan_sent(job_id: str, idxs: Iterable[int]) -> None:
    """Planning tasks for these objects were sent now (a lost one is sent again later)."""
    with tx() as conn:
        conn.execute(update(job_inputs).where(job_inputs.c.job_id == job_id, job_inputs.c.idx.in_(list(idxs)))
                     .values(dispatched_at=now()))


def plan_attempt_started(job_id: str, idx: int) -> bool:
    """Count one more planning attempt of the object (before it starts, so an attempt that hangs
    or kills its worker counts too); False when the object is already planned (a duplicate) or
    the job has left planning (one statement: a planning task's bookkeeping is two per object)."""
    planning = select(jobs.c.id).where(jobs.c.id == job_id, jobs.c.status == JobStatus.PLANNING.value).exists()
    with tx() as conn:
        return conn.execute(update(job_inputs).where(
            job_inputs.c.job_id == job_id, job_inputs.c.idx == idx, job_inputs.c.records.is_(None), planning)
            .values(attempts=job_inputs.c.attempts + 1, started_at=now(), error=None)).rowcount == 1


def plan_attempts_started(job_id: str, idxs: list[int]) -> set[int]:
    """plan_attempt_started for many objects (an embedded planner's), a statement per 1,000: the
    objects whose attempt it counted."""
    planning = select(jobs.c.id).where(jobs.c.id == job_id, jobs.c.status == JobStatus.PLANNING.value).exists()
    started: set[int] = set()
    for k in range(0, len(idxs), 1000):
        with tx() as conn:
            started.update(conn.execute(update(job_inputs).where(
                job_inputs.c.job_id == job_id, job_inputs.c.idx.in_(idxs[k:k + 1000]), job_inputs.c.records.is_(None),
                planning).values(attempts=job_inputs.c.attempts + 1, started_at=now(), error=None)
                .returning(job_inputs.c.idx)).scalars())
    return started


def plan_part_started(job_id: str, idx: int) -> None:
    """A part of the object's current planning attempt started (distributed planning in parts):
    the attempt is alive, its time limit counted from now."""
    with tx() as conn:
        conn.execute(update(job_inputs).where(job_inputs.c.job_id == job_id, job_inputs.c.idx == idx,
                                              job_inputs.c.records.is_(None)).values(started_at=now()))


def plan_attempt_failed(job_id: str, idx: int, error: str) -> None:
    with tx() as conn:
        conn.execute(update(job_inputs).where(job_inputs.c.job_id == job_id, job_inputs.c.idx == idx)
                     .values(error=error[:4000]))


def replan(job_id: str, idxs: list[int], error: str) -> None:
    """These objects are to be planned again (their staged files were lost): unplanned, their
    `error` saying why, sent again at the lifecycle's next step; their attempts still count."""
    with tx() as conn:
        conn.execute(update(job_inputs).where(job_inputs.c.job_id == job_id, job_inputs.c.idx.in_(idxs))
                     .values(records=None, error=error[:4000], dispatched_at=None))


def objects_planned(job_id: str, records: dict[int, int]) -> None:
    """These objects are planned, with their record counts (a staged group's): one statement."""
    if not records:
        return
    with tx() as conn:
        conn.execute(update(job_inputs).where(job_inputs.c.job_id == job_id, job_inputs.c.idx == bindparam("b_idx"))
                     .values(records=bindparam("b_records")),
                     [{"b_idx": i, "b_records": n} for i, n in records.items()])


def object_planned(job_id: str, idx: int, records: int) -> None:
    with tx() as conn:
        conn.execute(update(job_inputs).where(job_inputs.c.job_id == job_id, job_inputs.c.idx == idx)
                     .values(records=records))


ANALYZE_AFTER_SHARDS = 10_000


def start_running(job_id: str, shard_rows: list[dict[str, Any]], plan: str, records_total: int,
                  plan_seconds: float, *, hold: bool = False) -> bool:
    """planning -> running (a held job: -> planned) with the planned shards, in one transaction;
    False when another planner finished first."""
    with tx() as conn:
        if conn.execute(select(jobs.c.status).where(jobs.c.id == job_id)).scalar() != JobStatus.PLANNING:
            return False
        if shard_rows:
            conn.execute(insert(shards), shard_rows)
        moved = transition(conn, job_id, JobStatus.PLANNED if hold else JobStatus.RUNNING,
                           detail={"shards": len(shard_rows)}, plan=plan, records_total=records_total,
                           plan_seconds=plan_seconds,
                           error_records=sum(r["num_records"] for r in shard_rows if r["bucket"] < 0))
    if moved and len(shard_rows) >= ANALYZE_AFTER_SHARDS:
        with tx() as conn:
            if conn.dialect.name == "postgresql":    # plan the job's queries on its real size at once,
                conn.execute(text("ANALYZE shards"))  # not after autovacuum gets to it
    return moved


def release(job_id: str) -> bool:
    """planned -> running: a dry run's job runs its planned shards, without planning again."""
    with tx() as conn:
        return transition(conn, job_id, JobStatus.RUNNING, detail="started after a dry run", hold=False)
