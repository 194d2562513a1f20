"""One lifecycle for every driver: a table from job status to the step that advances it.

The embedded driver (`controller.drive`, one job on this machine) and the distributed
`controller.Controller` (every job of a shared ledger) both call `advance`; they differ only in the
`Dispatcher` that delivers work. Every step starts from the job as just read from the ledger, passes
that `Job` down (nothing below reads it again), and is safe to re-run after a crash. A step that
raises is charged to its job alone, as the `RetryPolicy` decides (Stage.STEP): permanent errors fail
the job at once with their message; others are retried, after a backoff (`retry_in`, up to
`BATCHINF_STEP_RETRY_CAP` seconds), and fail the job after `BATCHINF_MAX_STEP_FAILURES` consecutive
failures.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

from batchinf import logs, metrics
from batchinf import planning
from batchinf.planning import sizing
from batchinf.config import settings
from batchinf.dispatch import Dispatcher
from batchinf.ledger import attempts as attempt_repo
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import leases
from batchinf.ledger import shards as shard_repo
from batchinf.ledger import splits, tallies
from batchinf.ledger.events import now
from batchinf.ledger.models import Demand, InputObject, Job
from batchinf.ledger.states import JOB_TERMINAL, JobStatus
from batchinf.limits import error_budget_problem
from batchinf.quarantine import resolve_quarantined
from batchinf.retry_policy import Action, RetryPolicy, Stage
from batchinf.store import get_store, join
from batchinf.verify import publish, publish_partial

log = logging.getLogger("batchinf.lifecycle")


PLAN_GRACE_SECONDS = 60.0     # past BATCHINF_PLAN_TIME_LIMIT, a silent planning attempt is dead


# job id -> (its status, consecutive failed steps, monotonic time before which the step is not
# retried): the backoff of this process's drivers; a restarted driver retries at once
_retry_at: dict[str, tuple[str, int, float]] = {}


def retry_in(job_id: str) -> float:
    """Seconds until the job's failed step may run again (0: now). `step` skips the job until
    then, so neither driver spends a job's step budget in the first seconds of an outage: with the
    defaults, ten consecutive failures take about 90 s on average."""
    entry = _retry_at.get(job_id)
    return max(0.0, entry[2] - time.monotonic()) if entry else 0.0


def _back_off(job: Job, policy: RetryPolicy) -> None:
    failures = _retry_at.get(job.id, ("", 0, 0.0))[1] + 1
    _retry_at[job.id] = (job.status, failures, time.monotonic() + policy.backoff(Stage.STEP, failures))


def _plan(job: Job, d: Dispatcher, slots: int | None) -> None:
    """Stage every input object (one planning task each), then run the global step. An object
    whose `max_attempts` planning attempts all failed (raised, timed out or died) fails the job."""
    objects = job_repo.inputs(job.id)
    if all(o.records is not None for o in objects):
        planning.finish_plan(job, d.workers(job.route))
        return
    s, t, policy = settings(), now(), RetryPolicy.from_settings()
    open_ = [o for o in objects if o.records is None]
    for o in open_:
        if policy.decide(None, o.attempts, stage=Stage.PLAN).action is Action.GIVE_UP and not _planning_now(o, d, t):
            why = o.error or (f"its last attempt ran past BATCHINF_PLAN_TIME_LIMIT ({s.plan_time_limit:g} s) "
                              "or its worker died" if d.resends_lost else "its last attempt did not finish")
            job_repo.fail(job.id, f"planning object {o.pin.uri} failed {o.attempts} times: {why}")
            return
    due = [o.idx for o in open_ if not _planning_now(o, d, t)
           and (o.dispatched_at is None or o.dispatched_at < t - _plan_wait(o, d, policy))]
    if due:
        job_repo.plan_sent(job.id, due)
        d.plan(job, due)


def _planning_now(o: InputObject, d: Dispatcher, t: float) -> bool:
    """A planning attempt of the object may still be running: one started since the last message
    (broker dispatchers; embedded planning runs inside the step), has not failed, and is within
    the time limit."""
    return (d.resends_lost and o.error is None and o.started_at is not None
            and o.started_at >= (o.dispatched_at or 0.0)
            and t - o.started_at < settings().plan_time_limit + PLAN_GRACE_SECONDS)


def _plan_wait(o: InputObject, d: Dispatcher, policy: RetryPolicy) -> float:
    """Seconds before a planning task is sent again: none in embedded mode (planning ran inside an
    earlier step, and the driver backs off after a failed step); through a broker a failed attempt
    backs off as the policy says (Stage.PLAN) and a message that may be lost waits `requeue_seconds`."""
    if not d.resends_lost:
        return 0.0
    if o.error is None:
        return d.requeue_seconds
    return min(d.requeue_seconds, policy.backoff(Stage.PLAN, o.attempts))


def _run(job: Job, d: Dispatcher, slots: int | None) -> None:
    """The running tick: recover lost leases and poison shards, fail the job past its error
    budget (`limits.error_budget_problem`), verify when all is done, else
    dispatch up to `slots` shards (None: no limit), re-send lost messages, ask for twins of
    stragglers, ask running shards to split while workers idle (`ledger.splits`), and delete the
    files of attempts that lost."""
    s = settings()
    metrics.leases_expired(leases.expire_leases(job.id, RetryPolicy.from_settings(), dead_owners=d.dead_workers(job)))
    resolve_quarantined(job)
    if problem := error_budget_problem(job):    # too many failed records: red, not green
        _give_up(job, problem)
        return
    if shard_repo.verify_when_done(job.id):
        if d.sweeps:        # every shard is done: the last ones' losers too (none is left to a later tick)
            _sweep(job)
        return
    fresh = shard_repo.dispatch_ready(job.id, limit=slots) if slots != 0 else []
    resend = [x for x in shard_repo.stale_queued(job.id, d.requeue_seconds) if x not in fresh] \
        if d.resends_lost else []
    if fresh or resend:
        d.send(fresh + resend)
        shard_repo.mark_dispatched(fresh + resend)
        metrics.shards_sent(len(fresh), len(resend))
    for shard_id in shard_repo.stragglers(job.id, s.speculate_factor, s.speculate_min_seconds):
        d.speculate(shard_id)
    if (workers := d.workers(job.route)) and s.split_chunk_tokens:   # idle workers: split the largest
        least, soon = sizing.split_bounds(float(job.plan.get("work_per_token", 1.0)))
        splits.request_split(job.id, workers, least, soon_work=soon)
    d.keep_up(job, shard_repo.open_count(job.id))
    if d.sweeps:
        _sweep(job)


def _sweep(job: Job) -> None:
    """Delete the files of attempts that lost (failed, their worker died or stalled, or a twin won)
    once their shard is done (`attempts.losers`), and mark them `swept`."""
    for shard_id, number in attempt_repo.losers(job.id):
        base = join(job.work_uri, "attempts", shard_id, f"a{number}")
        get_store(base).delete_prefix(base)
        attempt_repo.swept(shard_id, number)


def _stop(job: Job, d: Dispatcher, slots: int | None) -> None:
    """cancelling -> cancelled/expired once no attempt can still commit: leases released,
    committed parts promoted, `_PARTIAL.json` written."""
    if d.quiesce(job):
        leases.release_leases(job.id)
        publish_partial(job)


PINNING = "pinning inputs"


def pin_now(job_id: str) -> None:
    """A pinning task (sent by `Dispatcher.pin`): pin the job if it still waits for it, the failure
    charged to the job as a failed step would be."""
    with logs.context(job_id=job_id):
        job = job_repo.get(job_id)
        if job.status != JobStatus.SUBMITTED:
            return
        try:
            planning.pin_job(job)
        except Exception as exc:  # noqa: BLE001 -- charged to this job alone
            _charge(job, PINNING, exc)
        else:
            if job.step_failures:
                job_repo.step_succeeded(job.id)


Step = Callable[[Job, Dispatcher, "int | None"], None]
STEPS: dict[JobStatus, tuple[str, Step]] = {
    JobStatus.SUBMITTED: (PINNING, lambda job, d, slots: d.pin(job)),
    JobStatus.PLANNING: ("planning", _plan),
    JobStatus.RUNNING: ("running", _run),
    JobStatus.VERIFYING: ("verification", lambda job, d, slots: publish(job)),
    JobStatus.CANCELLING: ("cancelling", _stop),
}


class Stepped(NamedTuple):
    ok: bool        # False: the step failed (it is charged to the job)
    status: str     # the job's status after the step


def step(job_id: str, dispatcher: Dispatcher, slots: int | None = None) -> bool:
    """Advance one job by one step (`advance`), reading it first; False when the step failed."""
    return advance(job_repo.get(job_id), dispatcher, slots).ok


def advance(job: Job, dispatcher: Dispatcher, slots: int | None = None) -> Stepped:
    """Advance the job, as just read, by one step: the step and everything below it take this
    `Job` and never read it again. A failed step is charged to the job; a job whose last step
    failed in its current status waits out `retry_in` (ok, nothing done). A step that moves the
    job logs the transition (`job_id`, `from_status`, `to_status`)."""
    with logs.context(job_id=job.id):
        tallies.compact(job.id)
        before = job.status
        job = job_repo.cancel_if_past_deadline(job)
        ok = True
        waiting = _retry_at.get(job.id, ("",))[0] == job.status and retry_in(job.id) > 0
        if job.status in STEPS and not waiting:
            stage, fn = STEPS[JobStatus(job.status)]
            try:
                fn(job, dispatcher, slots)
            except Exception as exc:  # noqa: BLE001 -- one job's failure never stops the others
                _charge(job, stage, exc)
                ok = False
            else:
                _retry_at.pop(job.id, None)
                if job.step_failures:
                    job_repo.step_succeeded(job.id)
        after = job_repo.status_of(job.id) if before not in JOB_TERMINAL else before
        if after in JOB_TERMINAL:
            _retry_at.pop(job.id, None)
        if after != before:
            log.info("job %s: %s -> %s", job.id, before, after, extra={"from_status": before, "to_status": after})
        return Stepped(ok, after)


def _charge(job: Job, stage: str, exc: Exception) -> None:
    """A failed step, charged as the policy decides: fail the job now (permanent), or count it and
    fail the job once it has failed `max_step_failures` times in a row. A stopping job ends
    stopped, never stuck."""
    policy = RetryPolicy.from_settings()
    _back_off(job, policy)      # first, in memory: recording the failure in the ledger may fail too
    try:
        if (decision := policy.decide(exc, 1, stage=Stage.STEP)).action is Action.FAIL_JOB:
            _give_up(job, f"{stage} {decision.reason}")
            return
        failures = job_repo.step_failed(job.id)
        log.warning("job %s: %s (%d in a row): %s: %s", job.id, stage, failures, type(exc).__name__, exc)
        if (decision := policy.decide(exc, failures, stage=Stage.STEP)).action is Action.GIVE_UP:
            _give_up(job, f"{stage} {decision.reason}")
    except Exception as again:  # noqa: BLE001 -- the ledger itself is down: the next tick retries
        log.warning("job %s: %s: %s (and recording it failed: %s)", job.id, stage, exc, again)


def _give_up(job: Job, reason: str) -> None:
    log.error("job %s: %s", job.id, reason)
    if job.status == JobStatus.CANCELLING:
        expired = job.deadline_at is not None and job.deadline_at <= now()
        job_repo.move(job.id, JobStatus.EXPIRED if expired else JobStatus.CANCELLED,
                      detail=reason, error=f"{job.error}; {reason}", finished_at=now())
    else:
        job_repo.fail(job.id, reason)


def in_flight_cap(max_in_flight: int, processes: int | None) -> int:
    """Shards that may be queued or running across all jobs: the worker processes that consume the
    queue plus what they are about to take (BATCHINF_DISPATCH_AHEAD, or a quarter of the processes
    if more), never above `max_in_flight`. The broker then holds only a few messages beyond the
    running shards, so an urgent job's first shard waits behind about that many, not behind a whole
    backfill (with 4 processes and 2 ahead: about half a shard time). Unknown processes (a cold
    fleet): the ahead margin alone, until workers answer."""
    n = processes or 0
    return max(1, min(max_in_flight, n + max(settings().dispatch_ahead, -(-n // 4))))


def share_slots(max_in_flight: int, demand: list[Demand]) -> dict[str, int]:
    """Fair share of the fleet's free dispatch slots: `max_in_flight` shards may be queued or
    running across all jobs; free slots go to jobs by priority, then earliest deadline, and
    round-robin between jobs that tie, each up to what it has ready. A big low-priority backfill
    therefore holds at most the slots it already has when an urgent job arrives, and gets no new
    ones while the urgent job is being planned or has shards ready."""
    free = max(0, max_in_flight - sum(d.in_flight for d in demand))
    shares = {d.job_id: 0 for d in demand}
    by_class: dict[tuple[int, float], list[Demand]] = {}
    for d in demand:
        by_class.setdefault((-d.priority, d.deadline_at or float("inf")), []).append(d)
    for key in sorted(by_class):
        group = sorted(by_class[key], key=lambda d: d.created_at)
        while free and any(shares[d.job_id] < d.ready for d in group):
            for d in group:
                if free and shares[d.job_id] < d.ready:
                    shares[d.job_id] += 1
                    free -= 1
    return shares
