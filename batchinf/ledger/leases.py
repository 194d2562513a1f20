"""Leases, heartbeats and the fenced commit: every write an attempt makes to the ledger.

Invariants enforced here:
- a shard's `attempt` column is the fencing token: only the attempt holding it may extend the
  lease or fail the shard, so a zombie attempt can never overwrite a newer one;
- a straggler may also have one speculative attempt running beside the holder; whichever of the
  two commits first wins (the commit is conditional on the shard still running and the attempt
  row still `running`), and the other is marked `superseded`, stops at its next heartbeat and
  loses its files. An attempt that is lost, failed or superseded can never commit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from sqlalchemy import Connection, and_, bindparam, func, insert, select, update

from batchinf.config import settings
from batchinf.errors import StaleAttemptError
from batchinf.ledger import events
from batchinf.ledger import jobs as job_repo
from batchinf.ledger.attempts import end_attempt
from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.models import Job, Lease, Shard, ShardResult, bounded_error
from batchinf.ledger.shards import transition as transition_shard
from batchinf.ledger.states import AttemptStatus, JobStatus, ShardStatus, attempt_sources, shard_sources
from batchinf.ledger.tables import attempts, jobs, record_errors, shards
from batchinf.retry_policy import Action, AttemptEnd, RetryPolicy


def _next_attempt(shard_id: Any) -> Any:
    """max(attempt number) + 1 over every attempt of the shard, speculative ones included."""
    return (select(func.coalesce(func.max(attempts.c.number), 0) + 1)
            .where(attempts.c.shard_id == shard_id).scalar_subquery())


def _host(worker: str, host: str | None) -> str:
    """An attempt's host: the one named (a Celery node), else the machine in `worker` (host:pid)."""
    return host or worker.rpartition(":")[0] or worker


def _take(conn: Connection, shard_id: str, job: Any, worker: str, lease_seconds: float,
          host: str | None = None) -> Lease | None:
    """Lease a queued shard of `job` (its row, read in this transaction) to `worker`."""
    t = now()
    row = conn.execute(_TAKE, {"b_shard": shard_id, "lease_owner": worker, "lease_expires_at": t + lease_seconds,
                               "updated_at": t}).first()
    if row is None:
        return None
    number = row.attempt
    conn.execute(_NEW_ATTEMPT, {"shard_id": shard_id, "number": number, "worker": worker, "host": _host(worker, host),
                                "status": AttemptStatus.RUNNING.value, "started_at": t, "heartbeat_at": t})
    events.record(conn, job.id, "shard", ShardStatus.QUEUED.value, ShardStatus.RUNNING.value,
                  shard_id=shard_id, detail={"attempt": number, "worker": worker})
    return Lease(shard_id, job.id, number, worker, Shard.from_row(row), Job.from_row(job))


# Built once with bind parameters (the values come with each execution): a statement costs more
# CPU to build than to run, and claims, heartbeats and commits are the ledger's hot path.
_TAKE = (update(shards).where(shards.c.id == bindparam("b_shard"), shards.c.status == ShardStatus.QUEUED.value)
         .values(status=ShardStatus.RUNNING.value, attempt=_next_attempt(bindparam("b_shard")), progress_records=0,
                 progress_steps=0, split_requested_at=None)
         .returning(*shards.c))
_NEW_ATTEMPT = insert(attempts)
# a worker claims only shards of jobs on the engines it has (b_engines) and on its device or any
# (b_devices; batchinf/engines)
_ON_ENGINES = and_(jobs.c.engine.in_(bindparam("b_engines", expanding=True)),
                   jobs.c.device.in_(bindparam("b_devices", expanding=True)))
_RUNNING_JOBS = select(jobs.c.id).where(jobs.c.status == JobStatus.RUNNING.value, _ON_ENGINES) \
    .order_by(jobs.c.priority.desc(), jobs.c.created_at, jobs.c.id)
# a worker of named jobs (one, embedded) reads their rows in the same statement: the lease carries its job
_RUNNING_OF = select(jobs).where(jobs.c.status == JobStatus.RUNNING.value, _ON_ENGINES,
                                 jobs.c.id.in_(bindparam("b_jobs", expanding=True))) \
    .order_by(jobs.c.priority.desc(), jobs.c.created_at, jobs.c.id)
NATIVE_ONLY = ("native",)     # a worker that names no engines has batchinf's own runtime only
CPU_ONLY = ("any", "cpu")     # a worker that names no device claims no job that needs cuda
_JOB_ROW = select(jobs).where(jobs.c.id == bindparam("b_job"))
_NEXT_QUEUED = (select(shards.c.id).where(shards.c.job_id == bindparam("b_job"),
                                          shards.c.status == ShardStatus.QUEUED.value)
                .order_by(shards.c.bucket.desc(), shards.c.ordinal).limit(1))
_NEXT_QUEUED_PG = _NEXT_QUEUED.with_for_update(skip_locked=True)


def _on(engines: Iterable[str], devices: Iterable[str]) -> dict[str, list[str]]:
    return {"b_engines": list(engines), "b_devices": list(devices)}


def _claim(q: Any, worker: str, lease_seconds: float, host: str | None,
           engines: Iterable[str] = NATIVE_ONLY, devices: Iterable[str] = CPU_ONLY) -> Lease | None:
    with tx() as conn:
        if conn.dialect.name == "postgresql":
            q = q.with_for_update(of=shards, skip_locked=True)
        row = conn.execute(q, _on(engines, devices)).first()
        if row is None:
            return None
        return _take(conn, row.id, conn.execute(_JOB_ROW, {"b_job": row.job_id}).one(), worker, lease_seconds, host)


def _queued_of_running_jobs() -> Any:
    return (select(shards.c.id, shards.c.job_id).join(jobs, jobs.c.id == shards.c.job_id)
            .where(shards.c.status == ShardStatus.QUEUED.value, jobs.c.status == JobStatus.RUNNING.value, _ON_ENGINES))


def claim_next(job_ids: Iterable[str] | None, worker: str, lease_seconds: float,
               host: str | None = None, engines: Iterable[str] = NATIVE_ONLY,
               devices: Iterable[str] = CPU_ONLY) -> Lease | None:
    """Lease the next queued shard (of the given jobs, or any running job) whose job runs on one
    of `engines` and on one of `devices`, highest priority job first, then in the job's dispatch order: one probe of the
    dispatch-order index per running job, not a sort of every queued shard. The lease carries the
    shard and its job."""
    on = _on(engines, devices)
    with tx() as conn:
        probe = _NEXT_QUEUED_PG if conn.dialect.name == "postgresql" else _NEXT_QUEUED
        if job_ids is not None:
            for job in conn.execute(_RUNNING_OF, {"b_jobs": list(job_ids), **on}).all():
                if (shard_id := conn.execute(probe, {"b_job": job.id}).scalar()) is not None:
                    return _take(conn, shard_id, job, worker, lease_seconds, host)
            return None
        for job_id in conn.execute(_RUNNING_JOBS, on).scalars().all():
            if (shard_id := conn.execute(probe, {"b_job": job_id}).scalar()) is not None:
                job = conn.execute(_JOB_ROW, {"b_job": job_id}).one()
                return _take(conn, shard_id, job, worker, lease_seconds, host)
    return None


def claim_shard(shard_id: str, worker: str, lease_seconds: float, host: str | None = None,
                engines: Iterable[str] = NATIVE_ONLY, devices: Iterable[str] = CPU_ONLY) -> Lease | None:
    """Lease one named shard; None when it is not queued (duplicate delivery, already leased or
    committed), its job is not running, or runs on an engine not among `engines` or a device not
    among `devices` (a message on the wrong queue). `host`: the worker's failure domain (default:
    its machine)."""
    return _claim(_queued_of_running_jobs().where(shards.c.id == shard_id), worker, lease_seconds, host, engines,
                  devices)


def retry_elsewhere(shard_id: str, host: str, policy: RetryPolicy) -> bool:
    """True when `host` should leave this shard to another host: its last attempt failed or was
    lost on `host` less than `policy.retry_elsewhere_seconds` ago and another host ran an attempt
    lately (`policy.live_host_seconds`). A broken host (a full scratch disk, a bad GPU) then does
    not spend the shard's attempts."""
    with tx() as conn:
        last = conn.execute(select(attempts.c.host, attempts.c.status, attempts.c.finished_at)
                            .where(attempts.c.shard_id == shard_id).order_by(attempts.c.number.desc()).limit(1)).first()
        if (last is None or last.host != host or (last.finished_at or 0.0) < now() - policy.retry_elsewhere_seconds
                or last.status not in (AttemptStatus.FAILED.value, AttemptStatus.LOST.value)):
            return False
        return conn.execute(_hosts_seen(policy.live_host_seconds, besides=host).limit(1)).first() is not None


def computing(lease: Lease, on: bool) -> None:
    """The attempt starts (on) or stops running its shard's records: a worker lost meanwhile
    counts against them (`RetryPolicy.end_attempt`)."""
    with tx() as conn:
        conn.execute(update(attempts).where(attempts.c.shard_id == lease.shard_id, attempts.c.number == lease.attempt)
                     .values(computing_at=now() if on else None))


def claim_speculative(shard_id: str, worker: str, host: str | None = None,
                      engines: Iterable[str] = NATIVE_ONLY, devices: Iterable[str] = CPU_ONLY) -> Lease | None:
    """Start a speculative attempt beside the running one, on another worker; None when the
    shard is not running, already has a twin, `worker` is the one running it, or its job runs on
    an engine not among `engines` or a device not among `devices`."""
    with tx() as conn:
        q = (select(shards).join(jobs, jobs.c.id == shards.c.job_id)
             .where(shards.c.id == shard_id, shards.c.status == ShardStatus.RUNNING.value,
                    jobs.c.status == JobStatus.RUNNING.value, _ON_ENGINES))
        if conn.dialect.name == "postgresql":
            q = q.with_for_update(of=shards)
        shard = conn.execute(q, _on(engines, devices)).first()
        if shard is None:
            return None
        live = conn.execute(select(attempts.c.worker).where(
            attempts.c.shard_id == shard_id, attempts.c.status == AttemptStatus.RUNNING.value)).scalars().all()
        if len(live) != 1 or live[0] == worker:
            return None
        number = conn.execute(select(_next_attempt(shard_id))).scalar()
        t = now()
        conn.execute(insert(attempts).values(shard_id=shard_id, number=number, worker=worker, host=_host(worker, host),
                                             status=AttemptStatus.RUNNING.value, started_at=t, heartbeat_at=t))
        events.record(conn, shard.job_id, "attempt", None, AttemptStatus.RUNNING.value, shard_id=shard_id,
                      detail={"attempt": number, "worker": worker, "speculative": True})
        job = conn.execute(_JOB_ROW, {"b_job": shard.job_id}).one()
        return Lease(shard_id, shard.job_id, number, worker, Shard.from_row(shard), Job.from_row(job))


def heartbeat(lease: Lease, lease_seconds: float, progress_records: int | None = None,
              progress_steps: int | None = None) -> bool:
    """Extend the lease (and, from the attempt holding the shard, record how many of its records
    are done and its progress units so far, Task.progress_unit: the status counts them before
    the shard commits); False when the attempt can no
    longer commit (fenced off, superseded, or its job stopped): the worker then stops working on it."""
    t = now()
    key = {"b_shard": lease.shard_id, "b_number": lease.attempt}
    with tx() as conn:
        if conn.execute(_BEAT_ATTEMPT, {**key, "b_job": lease.job_id, "heartbeat_at": t}).rowcount != 1:
            return False
        extend = {"lease_expires_at": t + lease_seconds}
        if progress_records is not None:
            extend["progress_records"] = progress_records
        if progress_steps is not None:
            extend["progress_steps"] = progress_steps
        conn.execute(_BEAT_SHARD, {**key, **extend})     # the holder's lease (a twin holds none)
        return True


# A cancelling job's attempts still beat and commit what they have finished (they stop at their
# next batch: `splits.stop_wanted`); once it is cancelled, expired or failed nothing commits.
_COMMITTING = (JobStatus.RUNNING.value, JobStatus.CANCELLING.value)
# built once, like _TAKE: heartbeats are the ledger's most frequent writes
_BEAT_ATTEMPT = update(attempts).where(      # the attempt runs, its shard runs, its job runs
    attempts.c.shard_id == bindparam("b_shard"), attempts.c.number == bindparam("b_number"),
    attempts.c.status == AttemptStatus.RUNNING.value,
    select(shards.c.id).where(shards.c.id == bindparam("b_shard"),
                              shards.c.status == ShardStatus.RUNNING.value).exists(),
    select(jobs.c.id).where(jobs.c.id == bindparam("b_job"), jobs.c.status.in_(_COMMITTING)).exists())
_BEAT_SHARD = update(shards).where(shards.c.id == bindparam("b_shard"), shards.c.attempt == bindparam("b_number"))


def commit_attempt(lease: Lease, result: ShardResult) -> None:
    """Checkpoint: the shard becomes committed with this attempt's outputs, in one transaction,
    only if the attempt may still commit it (see `_COMMIT`) and the job is running or cancelling
    (a cancel keeps what running attempts finished; nothing commits once the job has stopped).
    The winner becomes the fencing token; a speculative twin still running is superseded. Raises StaleAttemptError otherwise."""
    with tx() as conn:
        commit_in(conn, lease, result)


def commit_in(conn: Connection, lease: Lease, result: ShardResult, **fields: Any) -> None:
    """`commit_attempt` inside the caller's transaction; `fields` are more shard columns to set
    (a split commit's shortened record count)."""
    # FOR SHARE (PostgreSQL) serializes with the job's cancel/expire transition (an UPDATE of the
    # row) while commits run side by side: a commit writes nothing to the job's row (its totals are tallies)
    q = _JOB_FOR_SHARE if conn.dialect.name == "postgresql" else _JOB_STATUS
    if conn.execute(q, {"b_job": lease.job_id}).scalar() not in _COMMITTING:
        raise StaleAttemptError(f"job {lease.job_id} has stopped; attempt {lease.attempt} "
                                f"of shard {lease.shard_id} is discarded")
    t, key = now(), {"b_shard": lease.shard_id, "b_number": lease.attempt}
    won = conn.execute(_COMMIT, {
        **key, "status": ShardStatus.COMMITTED.value, "updated_at": t, "attempt": lease.attempt, "lease_owner": None,
        "lease_expires_at": None, "last_error": None, "output_uri": result.output_uri,
        "output_sha256": result.output_sha256, "output_rows": result.output_rows, "errors_uri": result.errors_uri,
        "errors_sha256": result.errors_sha256, "error_rows": result.error_rows, "tokens_input": result.tokens_input,
        "tokens_output": result.tokens_output, "tokens_real": result.tokens_real,
        "tokens_padded": result.tokens_padded, "execute_seconds": result.execute_seconds,
        "progress_steps": result.progress, **fields})
    if won.rowcount != 1:
        raise StaleAttemptError(f"attempt {lease.attempt} of shard {lease.shard_id} lost its lease; "
                                "another attempt owns the shard")
    events.record(conn, lease.job_id, "shard", _COMMIT_FROM, ShardStatus.COMMITTED.value, shard_id=lease.shard_id,
                  detail={"attempt": lease.attempt, "rows": result.output_rows, "errors": result.error_rows})
    # the winner's attempt row (no event of its own: the shard's names it), then any twin loses
    conn.execute(_WINNER, {**key, "status": AttemptStatus.COMMITTED.value, "finished_at": t,
                           "load_seconds": result.load_seconds or None})
    if conn.execute(_TWIN, key).first() is not None:
        end_attempt(conn, lease.shard_id, None, AttemptStatus.SUPERSEDED, error=f"attempt {lease.attempt} committed first")
    if result.errors:
        conn.execute(insert(record_errors),
                     [bounded_error(dict(e, job_id=lease.job_id, shard_id=lease.shard_id)) for e in result.errors])


_JOB_STATUS = select(jobs.c.status).where(jobs.c.id == bindparam("b_job"))
_JOB_FOR_SHARE = _JOB_STATUS.with_for_update(read=True)
_RUNNING_ATTEMPT = select(attempts.c.number).where(
    attempts.c.shard_id == bindparam("b_shard"), attempts.c.number == bindparam("b_number"),
    attempts.c.status == AttemptStatus.RUNNING.value).exists()
(_COMMIT_FROM,) = shard_sources(ShardStatus.COMMITTED)      # the state table: a shard commits from running only
# The fenced commit: the shard still runs and this attempt may still commit it (its row is running:
# not lost, failed or superseded); the shard's `attempt` becomes the winner's.
_COMMIT = update(shards).where(shards.c.id == bindparam("b_shard"), shards.c.status == _COMMIT_FROM, _RUNNING_ATTEMPT)
_WINNER = update(attempts).where(attempts.c.shard_id == bindparam("b_shard"), attempts.c.number == bindparam("b_number"),
                                 attempts.c.status.in_(attempt_sources(AttemptStatus.COMMITTED)))
_TWIN = select(attempts.c.number).where(attempts.c.shard_id == bindparam("b_shard"),
                                        attempts.c.status.in_(attempt_sources(AttemptStatus.SUPERSEDED)))


def _count_failed(conn: Connection, job_id: str) -> tuple[int, int]:
    """Count one more failed attempt of the job: (its failed attempts now, its shards)."""
    conn.execute(update(jobs).where(jobs.c.id == job_id).values(failed_attempts=jobs.c.failed_attempts + 1))
    failed = conn.execute(select(jobs.c.failed_attempts).where(jobs.c.id == job_id)).scalar()
    return failed, conn.execute(select(func.count()).select_from(shards).where(shards.c.job_id == job_id)).scalar()


def _hosts_seen(seconds: float, besides: str | None = None) -> Any:
    """Hosts (failure domains) of attempts active in the last `seconds`, other than `besides`."""
    t = now() - seconds
    q = select(attempts.c.host).distinct().where(
        attempts.c.host.is_not(None), func.coalesce(attempts.c.finished_at, attempts.c.heartbeat_at, attempts.c.started_at) >= t)
    return q if besides is None else q.where(attempts.c.host != besides)


def _attempt_end(conn: Connection, shard_id: str, attempt: int, outcome: AttemptStatus,
                 policy: RetryPolicy) -> AttemptEnd:
    """The shard's attempts as attempt `attempt` ends with `outcome`, for `policy.end_attempt`."""
    rows = conn.execute(select(attempts.c.number, attempts.c.status, attempts.c.host, attempts.c.computing_at)
                        .where(attempts.c.shard_id == shard_id)).all()
    status = {r.number: (outcome.value if r.number == attempt else r.status) for r in rows}
    lost = [r for r in rows if status[r.number] == AttemptStatus.LOST.value]
    charged = [r for r in lost if r.computing_at is not None]
    return AttemptEnd(attempt=attempt, lost=outcome is AttemptStatus.LOST,
                      counts=outcome is AttemptStatus.FAILED or any(r.number == attempt for r in charged),
                      failed=sum(1 for v in status.values() if v == AttemptStatus.FAILED.value),
                      charged_hosts=[r.host for r in charged], lost_total=len(lost),
                      fleet_hosts=len(conn.execute(_hosts_seen(policy.live_host_seconds)).all()))


_TARGETS = {Action.RETRY: ShardStatus.RETRYING, Action.QUARANTINE: ShardStatus.QUARANTINED,
            Action.GIVE_UP: ShardStatus.FAILED}


def _end_lease(conn: Connection, shard_id: str, attempt: int, error: str, policy: RetryPolicy | None,
               outcome: AttemptStatus, give_up: bool = False) -> ShardStatus | None:
    """An attempt that raised (FAILED) or lost its worker (LOST) ends. For the attempt holding the
    shard, the shard goes where `policy.end_attempt` says: retrying (after its delay), quarantined
    or failed (a failed shard fails its job); `give_up`: it fails now; no policy (RELEASED: the
    worker gave the lease back): retrying at once, charged to nothing. A speculative attempt just
    ends: the attempt holding the shard carries on."""
    job_id, holder = conn.execute(select(shards.c.job_id, shards.c.attempt).where(shards.c.id == shard_id)).one()
    if holder != attempt:
        end_attempt(conn, shard_id, attempt, outcome, error=error[:4000])
        return None
    target, delay = ShardStatus.RETRYING, 0.0
    if policy is not None:
        facts = _attempt_end(conn, shard_id, attempt, outcome, policy)
        if outcome is AttemptStatus.FAILED:
            spent, count = _count_failed(conn, job_id)
            facts = dataclasses.replace(facts, spent=spent, shards=count, give_up=give_up)
        decision = policy.end_attempt(facts)
        target, delay = _TARGETS[decision.action], decision.delay
        if decision.reason:
            error = f"{decision.reason}; last error: {error}"
    if not transition_shard(conn, shard_id, target, fence=attempt, detail={"attempt": attempt, "error": error[:2000]},
                            lease_owner=None, lease_expires_at=None, last_error=error[:4000],
                            not_before=now() + delay):
        return None
    end_attempt(conn, shard_id, attempt, outcome, error=error[:4000])
    if target is ShardStatus.FAILED:
        reason = f"shard {shard_id} failed {attempt} attempts; last error: {error[:1000]}"
        job_repo.transition(conn, job_id, JobStatus.FAILED, detail=reason, error=reason, finished_at=now())
    return target


def fail_attempt(lease: Lease, error: str, policy: RetryPolicy | None = None, *,
                 give_up: bool = False) -> ShardStatus | None:
    """The attempt raised: record what `policy` (default: the settings') decides: retry later, or
    fail the shard (and its job) when attempts or the job's budget run out, or now (`give_up`: the
    worker's decision was FAIL_JOB)."""
    with tx() as conn:
        return _end_lease(conn, lease.shard_id, lease.attempt, error, policy or RetryPolicy.from_settings(),
                          AttemptStatus.FAILED, give_up)


def expire_leases(job_id: str | None, policy: RetryPolicy | None = None, *, dead_owners: Iterable[str] = (),
                  only_dead: bool = False, why: str = "") -> int:
    """Running shards whose lease expired (or whose owner is known dead) go to retrying, unless a
    live speculative attempt runs beside the lost one: that attempt then holds the shard. Silent
    speculative attempts are marked lost. `only_dead`: only the dead owners' attempts (`why` they
    died goes into their error). Returns how many leases expired."""
    t = now()
    dead = list(dead_owners)
    if only_dead and not dead:
        return 0
    lease_seconds = settings().lease_seconds
    policy = policy or RetryPolicy.from_settings()

    def lost(worker: str) -> str:
        if worker in dead:
            return f"lease released (worker {worker} died{': ' + why if why else ''})"
        return f"lease lost (worker {worker} stopped heartbeating)"

    with tx() as conn:
        cond = [shards.c.status == ShardStatus.RUNNING.value]
        if job_id is not None:
            cond.append(shards.c.job_id == job_id)
        silent = attempts.c.worker.in_(dead) if only_dead else attempts.c.heartbeat_at < t - lease_seconds
        if dead and not only_dead:
            silent = silent | attempts.c.worker.in_(dead)
        twins = conn.execute(select(attempts.c.shard_id, attempts.c.number, attempts.c.worker)
                             .join(shards, shards.c.id == attempts.c.shard_id)
                             .where(*cond, attempts.c.status == AttemptStatus.RUNNING.value,
                                    attempts.c.number != shards.c.attempt, silent)).all()
        for r in twins:
            _end_lease(conn, r.shard_id, r.number, f"speculative attempt: {lost(r.worker)}", policy,
                       AttemptStatus.LOST)
        expired = shards.c.lease_owner.in_(dead) if only_dead else shards.c.lease_expires_at < t
        if dead and not only_dead:
            expired = expired | shards.c.lease_owner.in_(dead)
        rows = conn.execute(select(shards.c.id, shards.c.job_id, shards.c.attempt, shards.c.lease_owner)
                            .where(*cond, expired)).all()
        for r in rows:
            error = lost(r.lease_owner)
            twin = conn.execute(select(attempts.c.number, attempts.c.worker, attempts.c.heartbeat_at).where(
                attempts.c.shard_id == r.id, attempts.c.number != r.attempt,
                attempts.c.status == AttemptStatus.RUNNING.value)).first()
            if twin is None:
                _end_lease(conn, r.id, r.attempt, error, policy, AttemptStatus.LOST)
                continue
            end_attempt(conn, r.id, r.attempt, AttemptStatus.LOST, error=error, detail={"holder_now": twin.number})
            conn.execute(update(shards).where(shards.c.id == r.id, shards.c.attempt == r.attempt).values(
                attempt=twin.number, lease_owner=twin.worker,
                lease_expires_at=(twin.heartbeat_at or t) + lease_seconds, updated_at=t))
    return len(rows)


def release_dead(workers: Iterable[str], why: str) -> int:
    """Workers known to have died (Celery's WorkerLostError, an exited pool process) lose their
    attempts now, not when their leases expire: their shards are retried at once."""
    return expire_leases(None, dead_owners=workers, only_dead=True, why=why)


def release_leases(job_id: str) -> None:
    """A stopped job's running shards give up their leases (their attempts are released)."""
    _release(shards.c.job_id == job_id, "job stopped")


def release_attempt(lease: Lease, why: str) -> None:
    """The attempt gives its lease back (its worker stops, or its job is cancelled before it
    finished a record): released, not charged; its shard may run again at once."""
    _release((attempts.c.shard_id == lease.shard_id) & (attempts.c.number == lease.attempt), why)


def release_workers(workers: Iterable[str], why: str) -> None:
    """The running attempts of these workers (stopped by their driver: Ctrl-C, shutdown) give
    their leases back, so the next driver runs their shards at once instead of after the lease."""
    if names := list(workers):
        _release(attempts.c.worker.in_(names), why)


def _release(which: Any, why: str) -> None:
    with tx() as conn:
        rows = conn.execute(select(attempts.c.shard_id, attempts.c.number)
                            .join(shards, shards.c.id == attempts.c.shard_id)
                            .where(which, shards.c.status == ShardStatus.RUNNING.value,
                                   attempts.c.status == AttemptStatus.RUNNING.value)
                            .order_by(attempts.c.number.desc())).all()   # twins before holders
        for r in rows:
            _end_lease(conn, r.shard_id, r.number, why, None, AttemptStatus.RELEASED)


def leases_held(job_id: str) -> int:
    """Running shards of the job whose lease has not expired yet."""
    with tx() as conn:
        return conn.execute(select(func.count()).select_from(shards).where(
            shards.c.job_id == job_id, shards.c.status == ShardStatus.RUNNING.value,
            shards.c.lease_expires_at >= now())).scalar()
