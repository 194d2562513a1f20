"""The status repository: the one status model every surface reads (`run/submit/status/jobs
--json`, `GET /v1/jobs/{id}`), keyset pages of jobs, shards and errors, and the ledger's
aggregates for metrics. Every query here costs one statement per aggregate for a whole page."""

from __future__ import annotations

import base64
import json
import math
import time
from typing import Any, NamedTuple

from sqlalchemy import Connection, func, select

from batchinf import phases
from batchinf.config import settings
from batchinf.errors import BatchinfError, LedgerError
from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.checks import clip
from batchinf.ledger import tallies
from batchinf.ledger.jobs import row as job_row
from batchinf.ledger.models import ERROR_ID_CHARS, ERROR_MESSAGE_CHARS
from batchinf.ledger.states import (ATTEMPT_LOSERS, JOB_ACTIVE, JOB_TERMINAL, SHARD_DONE, SHARD_WAITING, AttemptStatus,
                                    JobStatus,
                                    ShardStatus, values)
from batchinf.ledger.tables import attempts, bundles, job_events, jobs, record_errors, schedule_runs, shards


def status(job_id: str, *, tenant: str | None = None) -> dict[str, Any]:
    """The status object of `run/submit/status/jobs --json` and the REST API (one model for all),
    in two statements (the CLI polls it every tick): the job's row with its running aggregates and
    the jobs that retry it (`_with_aggregates`), and its tallies; a third for a job whose plan
    counts progress units (`_progress_done`).

    With `tenant`, a job of another tenant is reported exactly like a missing one."""
    retry = jobs.alias("retry")
    q = (_with_aggregates(select(jobs, retry.c.id.label("retried_by")))
         .outerjoin(retry, retry.c.retry_of == jobs.c.id).where(jobs.c.id == job_id)
         .order_by(retry.c.created_at, retry.c.id))
    if tenant is not None:
        q = q.where(jobs.c.tenant == tenant)
    with tx() as conn:
        rows = conn.execute(q).all()
        if not rows:
            raise LedgerError(f"no job {job_id!r}; see `batchinf jobs`")
        totals = tallies.read(conn, [job_id])
        done = _progress_done(conn, rows[:1])
    return _view(rows[0], totals[job_id], [r.retried_by for r in rows if r.retried_by is not None], done)


def _with_aggregates(q: Any) -> Any:
    """`q` (a select from `jobs`) with each job's aggregates as correlated columns: `in_running`,
    the records finished inside its running shards (their heartbeats' progress), and
    `live_seconds`, the worker seconds of its attempts still running, up to their last heartbeat."""
    in_running = (select(func.coalesce(func.sum(shards.c.progress_records), 0))
                  .where(shards.c.job_id == jobs.c.id, shards.c.status == ShardStatus.RUNNING.value)
                  .scalar_subquery())
    live = (select(func.coalesce(func.sum(
        func.coalesce(attempts.c.heartbeat_at, attempts.c.started_at) - attempts.c.started_at), 0.0))
        .select_from(attempts).join(shards, shards.c.id == attempts.c.shard_id)
        .where(attempts.c.finished_at.is_(None), shards.c.job_id == jobs.c.id).scalar_subquery())
    return q.add_columns(in_running.label("in_running"), live.label("live_seconds"))


def statuses(rows: list[Any]) -> list[dict[str, Any]]:
    """The status objects of these job rows (read `_with_aggregates`), in their order, with one
    statement for their tallies and one for the jobs that retry them (a page of 50 jobs costs as
    many statements as one job)."""
    if not rows:
        return []
    ids = [r.id for r in rows]
    with tx() as conn:
        totals = tallies.read(conn, ids)
        retries: dict[str, list[str]] = {i: [] for i in ids}
        for rid, of in conn.execute(select(jobs.c.id, jobs.c.retry_of).where(jobs.c.retry_of.in_(ids))
                                    .order_by(jobs.c.created_at, jobs.c.id)).all():
            retries[of].append(rid)
        done = _progress_done(conn, rows)
    return [_view(r, totals[r.id], retries[r.id], done) for r in rows]


def _view(row: Any, totals: tallies.JobTallies, retries: list[str], progress: dict[str, int]) -> dict[str, Any]:
    worker_seconds = totals.worker_seconds + float(row.live_seconds or 0.0)
    view = _status(row, totals, worker_seconds, int(row.in_running or 0))
    p = view["progress"]
    for unit in PROGRESS_UNITS:
        p[f"{unit}_planned"] = p[f"{unit}_done"] = None
    p["audio_seconds_per_second"] = None
    if (planned := _progress_planned(row)) is not None:
        unit, n = planned
        done = min(n, progress.get(row.id, 0))
        p.update({f"{unit}_planned": n, f"{unit}_done": done})
        if unit == "audio_seconds":
            elapsed = p["elapsed_seconds"]
            rate = done / elapsed if elapsed and done else None
            p["audio_seconds_per_second"] = rate
            if rate and row.status not in values(JOB_TERMINAL):     # the audio left, at the audio rate so far
                p["eta_seconds"] = max(0.0, (n - done) / rate)
    return {**view, "retry_of": row.retry_of, "retries": retries}


# what a task may count progress in besides records (Task.progress_unit): denoising steps x
# images (generate_image), audio seconds (transcribe); the status has `<unit>_planned` and
# `<unit>_done` for each, null for a task that does not count it
PROGRESS_UNITS = ("steps", "audio_seconds")


def _progress_planned(row: Any) -> tuple[str, int] | None:
    """(unit, the progress units the job's plan counted), or None for a task that counts only records."""
    if not row.plan or not any(f'"{u}"' in row.plan for u in PROGRESS_UNITS):
        return None
    plan = json.loads(row.plan)
    return next(((u, int(plan[u])) for u in PROGRESS_UNITS if plan.get(u) is not None), None)


PROGRESS_COUNTED = (ShardStatus.COMMITTED.value, ShardStatus.RUNNING.value)


def _progress_done(conn: Connection, rows: list[Any]) -> dict[str, int]:
    """Progress units done per job, for the jobs among `rows` whose plan counts them, in one
    statement: committed shards' (their records' planned units) plus running attempts' (their
    heartbeats'). A running attempt that re-runs a failed batch in halves counts it again: the
    status caps the sum at the plan's."""
    ids = [r.id for r in rows if _progress_planned(r) is not None]
    if not ids:
        return {}
    return {job_id: int(n) for job_id, n in conn.execute(
        select(shards.c.job_id, func.coalesce(func.sum(shards.c.progress_steps), 0))
        .where(shards.c.job_id.in_(ids), shards.c.status.in_(PROGRESS_COUNTED)).group_by(shards.c.job_id)).all()}


def _in_running(conn: Connection, ids: list[str]) -> dict[str, int]:
    """Records finished inside each job's running shards (their heartbeats' progress)."""
    return dict(conn.execute(
        select(shards.c.job_id, func.coalesce(func.sum(shards.c.progress_records), 0))
        .where(shards.c.job_id.in_(ids), shards.c.status == ShardStatus.RUNNING.value)
        .group_by(shards.c.job_id)).all())


def _waiting(row: Any, counts: dict[str, int]) -> str | None:
    """Why a running job's queued shards do not run: none is taken, so no worker with its engine
    (and device, when it needs one) is free."""
    queued = counts.get(ShardStatus.QUEUED, 0)
    if row.status != JobStatus.RUNNING or not queued or counts.get(ShardStatus.RUNNING, 0):
        return None
    if row.device == "any":
        return (f"{queued} shard(s) queued for engine {row.engine}, none running: they wait for a free worker with "
                f"engine {row.engine} (`batchinf worker --engine {row.engine}`, or `batchinf serve --engine "
                f"{row.engine}`)")
    return (f"{queued} shard(s) queued for engine {row.engine} on device {row.device}, none running: they wait "
            f"for a free worker with engine {row.engine} and device {row.device} (`batchinf worker --engine "
            f"{row.engine} --device {row.device}`, or `batchinf serve --engine {row.engine} --device {row.device}`)")


def _pieces_planned(row: Any) -> int:
    """The staged rows of the job's plan that continue a record staged in pieces (a long audio
    file in several rows): shards count rows, the job's counts records."""
    if not row.plan or '"pieces"' not in row.plan:
        return 0
    return int(json.loads(row.plan).get("pieces") or 0)


def _status(row: Any, totals: tallies.JobTallies, worker_seconds: float, in_running: int = 0) -> dict[str, Any]:
    """`counts.records_done` is the committed shards' records plus those the running shards'
    heartbeats report done (a generate shard shows progress before it commits). A job with records
    staged in pieces counts rows there: its records done are its rows done scaled to its records
    (never past them), and a record staged in pieces counts as succeeded or failed once it is
    published (its rows are no shard's output or error rows; the job's summary `pieces` counts it).
    A quarantined shard's poison row is a record done and failed."""
    done_sums = totals.shard_sums(ShardStatus.COMMITTED.value)
    ok, failed, tok_in, tok_real, tok_padded = (done_sums.output_rows, done_sums.error_rows, done_sums.tokens_input,
                                                done_sums.tokens_real, done_sums.tokens_padded)
    poison = totals.shard_sums(ShardStatus.QUARANTINED.value).error_rows    # a record alone that killed its workers
    failed += poison
    done = done_sums.records + poison + in_running
    if (pieces := _pieces_planned(row)) and row.records_total is not None:
        done = min(row.records_total, done * row.records_total // (row.records_total + pieces))
    summary = json.loads(row.summary) if row.summary else None
    if summary and isinstance(summary.get("pieces"), dict):
        ok += int(summary["pieces"].get("succeeded", 0))
        failed += int(summary["pieces"].get("failed", 0))
    counts = {st: t.n for st, t in totals.shards.items() if t.n}
    by_code = totals.errors_by_code
    total = sum(counts.values())
    t = now()
    elapsed = ((row.finished_at or t) - row.started_at) if row.started_at else None
    rps = done / elapsed if elapsed else None
    active = row.status not in values(JOB_TERMINAL)
    eta = None
    if active and rps and row.records_total is not None:
        eta = max(0.0, (row.records_total - done) / rps)
    price = settings().price_per_worker_hour
    cost = float(worker_seconds) / 3600 * price if price is not None else None
    return {
        "job_id": row.id, "name": row.name, "status": row.status, "tenant": row.tenant,
        "task": row.task, "output_uri": row.output_uri, "input_uri": row.input_uri,
        "bundle": row.bundle_ref, "bundle_digest": row.bundle_digest,
        "engine": row.engine, "device": row.device, "waiting": _waiting(row, counts),
        "schedule": row.schedule, "idempotency_key": row.idempotency_key, "priority": row.priority,
        "shards": {"total": total,
                   "done": sum(counts.get(s.value, 0) for s in SHARD_DONE),
                   "committed": counts.get(ShardStatus.COMMITTED, 0),
                   "running": counts.get(ShardStatus.RUNNING, 0),
                   "pending": sum(counts.get(s, 0) for s in SHARD_WAITING),
                   "quarantined": counts.get(ShardStatus.QUARANTINED, 0),
                   "failed": counts.get(ShardStatus.FAILED, 0)},
        "counts": {"records_total": row.records_total,
                   "records_done": done,
                   "records_succeeded": ok,
                   "records_failed": failed},
        "tokens": {"input": tok_in, "real": tok_real, "padded": tok_padded,
                   "padding_efficiency": tok_real / tok_padded if tok_padded else None},
        "progress": {"elapsed_seconds": elapsed, "records_per_second": rps,
                     "tokens_per_second": tok_in / elapsed if elapsed else None, "eta_seconds": eta},
        "worker_seconds": float(worker_seconds),
        "cost": None if cost is None else {
            "price_per_worker_hour": price, "total": cost,
            "per_1000_records": cost / done * 1000 if done else None},
        "errors": {"records": sum(by_code.values()), "by_code": by_code},
        "summary": summary,
        "phases": phases.view(row.phases, row.created_at, row.finished_at),
        "error": row.error, "deadline_at": row.deadline_at, "created_at": row.created_at,
        "updated_at": row.updated_at, "started_at": row.started_at, "finished_at": row.finished_at,
    }


def list_jobs(limit: int = 50, *, tenant: str | None = None, status_is: str | None = None,
              name: str | None = None, schedule: str | None = None,
              cursor: str | None = None) -> list[dict[str, Any]]:
    """Newest first; see `page_jobs` for the cursor."""
    return page_jobs(limit, tenant=tenant, status_is=status_is, name=name, schedule=schedule,
                     cursor=cursor)[0]


class CursorError(BatchinfError):
    """A pagination cursor this server did not issue."""


def encode_cursor(*key: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")


def _in_range(v: Any) -> bool:
    """A cursor value the database can compare: a 64-bit integer, a finite float, a short string."""
    if isinstance(v, int):
        return -(1 << 63) <= v < (1 << 63)
    if isinstance(v, float):
        return math.isfinite(v)
    return not isinstance(v, str) or len(v) <= 200


def decode_cursor(cursor: str, *types: type | tuple[type, ...]) -> list[Any]:
    """The sort key encoded by `encode_cursor`, checked against the expected types and ranges."""
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if (isinstance(key, list) and len(key) == len(types)
                and all(isinstance(v, t) and not isinstance(v, bool) and _in_range(v) for v, t in zip(key, types))):
            return key
    except (ValueError, TypeError, RecursionError):
        pass
    raise CursorError(f"cursor {cursor!r} is not valid; pass the next_cursor of the previous page "
                        "unchanged, or omit it for the first page")


def _fetch_page(q: Any, limit: int) -> tuple[list[Any], bool]:
    """Up to `limit` rows of an ordered query, and whether more follow."""
    with tx() as conn:
        rows = conn.execute(q.limit(limit + 1)).all()
    return rows[:limit], len(rows) > limit


def page_jobs(limit: int = 50, *, tenant: str | None = None, status_is: str | None = None,
              name: str | None = None, schedule: str | None = None, name_contains: str | None = None,
              cursor: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """One page of status objects, newest first, and the cursor of the next page (None at the end).
    `name_contains` matches a substring of the name, case-insensitively (% and _ are literal)."""
    q = _with_aggregates(select(jobs)).order_by(jobs.c.created_at.desc(), jobs.c.id.desc())
    for col, value in ((jobs.c.tenant, tenant), (jobs.c.status, status_is), (jobs.c.name, name),
                       (jobs.c.schedule, schedule)):
        if value is not None:
            q = q.where(col == value)
    if name_contains is not None:
        q = q.where(jobs.c.name.icontains(name_contains, autoescape=True))
    if cursor:
        created, last_id = decode_cursor(cursor, (int, float), str)
        q = q.where((jobs.c.created_at < created) | ((jobs.c.created_at == created) & (jobs.c.id < last_id)))
    rows, more = _fetch_page(q, limit)
    nxt = encode_cursor(rows[-1].created_at, rows[-1].id) if more else None
    return statuses(rows), nxt


SHARD_FIELDS = ("id", "bucket", "ordinal", "parent_id", "status", "attempt", "num_records", "num_tokens",
                "output_rows", "error_rows", "tokens_real", "tokens_padded", "execute_seconds",
                "last_error", "lease_owner", "lease_expires_at", "updated_at")


def page_shards(job_id: str, *, tenant: str | None = None, limit: int = 100, cursor: str | None = None,
                status_is: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """A job's shards in (bucket, ordinal) order, one page at a time."""
    job_row(job_id, tenant=tenant)
    q = (select(*(shards.c[f] for f in SHARD_FIELDS)).where(shards.c.job_id == job_id)
         .order_by(shards.c.bucket, shards.c.ordinal))
    if status_is is not None:
        q = q.where(shards.c.status == status_is)
    if cursor:
        bucket, ordinal = decode_cursor(cursor, int, int)
        q = q.where((shards.c.bucket > bucket) | ((shards.c.bucket == bucket) & (shards.c.ordinal > ordinal)))
    rows, more = _fetch_page(q, limit)
    return ([dict(r._mapping) for r in rows],
            encode_cursor(rows[-1].bucket, rows[-1].ordinal) if more else None)


ERROR_PAGE_BYTES = 1 << 20     # a page of errors stops growing past this many bytes of ids and messages


def page_errors(job_id: str, *, tenant: str | None = None, limit: int = 100, cursor: str | None = None,
                code: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """A job's record errors (as committed by their shards), in commit order, one page at a time.
    Ids and messages are cut to their bounds (rows stored before the bounds existed too), and a
    page stops at ERROR_PAGE_BYTES: its cursor then points past the last row it holds."""
    job_row(job_id, tenant=tenant)
    e = record_errors.c
    q = (select(e.id, e.shard_id, func.substr(e.record_id, 1, ERROR_ID_CHARS).label("record_id"),
                func.length(e.record_id).label("id_chars"), e.source, e.ordinal, e.error,
                func.substr(e.message, 1, ERROR_MESSAGE_CHARS).label("message"),
                func.length(e.message).label("message_chars"), e.attempts)
         .where(e.job_id == job_id).order_by(e.id))     # only a prefix of each id and message is read
    if code is not None:
        q = q.where(e.error == code)
    if cursor:
        q = q.where(e.id > decode_cursor(cursor, int)[0])
    rows, more = _fetch_page(q, limit)
    items: list[dict[str, Any]] = []
    size = 0
    for r in rows:
        item = {"shard_id": r.shard_id, "record_id": clip(r.record_id, ERROR_ID_CHARS, r.id_chars),
                "source": r.source, "ordinal": r.ordinal, "error": r.error,
                "message": clip(r.message, ERROR_MESSAGE_CHARS, r.message_chars), "attempts": r.attempts}
        size += sum(len(str(v)) for v in item.values()) + 100
        if items and size > ERROR_PAGE_BYTES:
            more = True
            break
        items.append(item)
    return items, encode_cursor(rows[len(items) - 1].id) if more and items else None


def metrics_snapshot(window_seconds: float) -> dict[str, Any]:
    """The ledger's aggregates for the Prometheus collector, one statement each: jobs by tenant and
    status (and every tenant, so that empty states read 0); recent jobs (active, or finished within
    `window_seconds`) and their shard sums by status; committed-shard sums per bundle and the
    bundles' names; attempt outcomes from the audit log (failed, lost, superseded from `attempt`
    events, committed from shards' `committed` events: counts that only grow); leases expired (lost
    attempts whose error is a lost lease); attempts running now; retries; quarantined shards; error
    rows by code; schedule runs."""
    s, ev = shards.c, job_events.c
    recent = (jobs.c.status.in_(values(JOB_ACTIVE))
              | (func.coalesce(jobs.c.finished_at, jobs.c.updated_at) >= time.time() - window_seconds))
    losers = values(ATTEMPT_LOSERS)
    with tx() as conn:
        job_rows = conn.execute(select(jobs.c.id, jobs.c.tenant, jobs.c.name, jobs.c.bundle_digest,
                                       jobs.c.status, jobs.c.records_total).where(recent)).all()
        ids = [r.id for r in job_rows]
        outcomes = dict(conn.execute(select(ev.to_status, func.count()).where(
            ev.kind == "attempt", ev.to_status.in_(losers)).group_by(ev.to_status)).all())
        outcomes[AttemptStatus.COMMITTED.value] = conn.execute(select(func.count()).where(
            ev.kind == "shard", ev.to_status == ShardStatus.COMMITTED.value)).scalar()
        return {
            "tenants": conn.execute(select(jobs.c.tenant).distinct()).scalars().all(),
            "by_status": conn.execute(select(jobs.c.tenant, jobs.c.status, func.count())
                                      .group_by(jobs.c.tenant, jobs.c.status)).all(),
            "jobs": job_rows,
            "per_job": _per_job(conn, ids),
            "per_bundle": _per_bundle(conn),
            "bundles": conn.execute(select(bundles.c.digest, bundles.c.name, bundles.c.task)).all(),
            "attempt_outcomes": sorted((o, outcomes.get(o, 0)) for o in [*losers, AttemptStatus.COMMITTED.value]),
            "leases_expired": conn.execute(select(func.count()).where(
                ev.kind == "attempt", ev.to_status == AttemptStatus.LOST.value,
                ev.detail.like('%"error": "lease lost%'))).scalar(),
            "attempts_running": conn.execute(select(func.count()).where(
                attempts.c.status == AttemptStatus.RUNNING.value)).scalar(),
            "retries": conn.execute(select(func.count()).where(attempts.c.number > 1)).scalar(),
            "quarantined": conn.execute(select(func.count()).where(
                s.status == ShardStatus.QUARANTINED.value)).scalar(),
            "errors": tallies.errors_by_code(conn),
            "schedule_runs": conn.execute(select(schedule_runs.c.schedule, func.count())
                                          .group_by(schedule_runs.c.schedule)).all(),
        }


class ShardSums(NamedTuple):
    """A job's shards in one status, summed (a row of `metrics_snapshot`'s per_job)."""
    job_id: str
    status: str
    n: int
    records: int
    output_rows: int
    error_rows: int
    tokens_input: int
    tokens_real: int
    tokens_padded: int
    execute_seconds: float
    progress_records: int


def _per_job(conn: Connection, ids: list[str]) -> list[ShardSums]:
    progress = _in_running(conn, ids) if ids else {}
    return [ShardSums(job_id, st, t.n, t.records, t.output_rows, t.error_rows, t.tokens_input, t.tokens_real,
                      t.tokens_padded, t.execute_seconds,
                      int(progress.get(job_id, 0)) if st == ShardStatus.RUNNING.value else 0)
            for job_id, totals in tallies.read(conn, ids).items() for st, t in totals.shards.items() if t.n]


def _per_bundle(conn: Connection) -> list[tuple[Any, ...]]:
    """(digest, shards, records, output rows, error rows, input/real/padded tokens, execute
    seconds) of every bundle's committed shards, from the jobs' tallies."""
    by_job = tallies.committed_by_job(conn)
    digests = dict(conn.execute(select(jobs.c.id, jobs.c.bundle_digest).where(jobs.c.id.in_(list(by_job)))).all()) \
        if by_job else {}
    out: dict[str, tallies.Tally] = {}
    for job_id, t in by_job.items():
        out.setdefault(digests[job_id], tallies.Tally()).add(t)
    return [(d, t.n, t.records, t.output_rows, t.error_rows, t.tokens_input, t.tokens_real, t.tokens_padded,
             t.execute_seconds) for d, t in sorted(out.items())]


def bundle_throughput(digest: str) -> tuple[float, int] | None:
    """Input tokens per worker-second that committed attempts of this bundle's jobs achieved
    (their tokens over their durations), and how many attempts that is; None before any ran."""
    done = attempts.c.status == AttemptStatus.COMMITTED.value
    with tx() as conn:
        tokens, seconds, n = conn.execute(
            select(func.sum(shards.c.tokens_input), func.sum(attempts.c.finished_at - attempts.c.started_at),
                   func.count()).select_from(attempts).join(shards, shards.c.id == attempts.c.shard_id)
            .join(jobs, jobs.c.id == shards.c.job_id).where(jobs.c.bundle_digest == digest, done)).one()
    return (float(tokens) / float(seconds), int(n)) if tokens and seconds else None
