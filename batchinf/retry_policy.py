"""The retry policy: what a failure means and what to do about it, for every stage. The stages ask
(`RetryPolicy.decide`, `RetryPolicy.end_attempt`); the ledger records what was decided.

What a failure is (`classify`):
- RETRY: transient (a storage, ledger or broker fault: storage 5xx or throttling, a lost, refused
  or timed-out connection, a local I/O error or full disk, a database restart; a worker without
  the requested device; anything unexpected), and any error raised *from* a transient fault (a
  part that "cannot be read" because the store was down): try again after a backoff, within the
  stage's attempts and the job's budget;
- FAIL_SHARD: the attempt lost its lease (`StaleAttemptError`): nothing to do, another
  attempt owns the shard;
- FAIL_JOB: no retry can fix it (bad input, bundle, manifest, missing object, a store refusing
  the request (no bucket, access denied), a real verification failure: coverage, a digest or
  row count that differs, an unlisted part): the job fails now with the message.

What to do (`Decision`): retry after `delay` seconds, abandon the attempt, fail the job, give up
(retries spent), or quarantine a shard whose attempts kill their workers (quarantine.py splits it).
The limits come from the settings (`RetryPolicy.from_settings`): BATCHINF_MAX_ATTEMPTS,
BATCHINF_JOB_RETRY_BUDGET, BATCHINF_RETRY_ELSEWHERE_SECONDS, BATCHINF_MAX_STEP_FAILURES,
BATCHINF_STEP_RETRY_CAP.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Callable, TypeVar

from batchinf.config import settings
from batchinf.errors import (BundleError, DeviceUnavailableError, InputError, ManifestError, StaleAttemptError,
                             StoreError, TransientError, VerificationError)

T = TypeVar("T")


class Outcome(StrEnum):
    """What kind of failure an exception is."""
    RETRY = "retry"
    FAIL_SHARD = "fail_shard"   # this attempt is over; the shard carries on without it
    FAIL_JOB = "fail_job"


PERMANENT = (BundleError, InputError, ManifestError, StoreError, VerificationError)


def classify(exc: BaseException) -> Outcome:
    if isinstance(exc, StaleAttemptError):
        return Outcome.FAIL_SHARD
    if isinstance(exc, (TransientError, DeviceUnavailableError)):   # another worker may have the device
        return Outcome.RETRY
    if isinstance(exc, PERMANENT):
        return Outcome.RETRY if caused_by_transient(exc) else Outcome.FAIL_JOB
    return Outcome.RETRY


def caused_by_transient(exc: BaseException) -> bool:
    """Whether a TransientError is among the explicit causes (`raise ... from`) of `exc`."""
    seen: set[int] = set()
    cause = exc.__cause__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, TransientError):
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return False


def compute_backoff(attempt: int, *, base: float = 1.0, cap: float = 30.0) -> float:
    """Capped exponential backoff with full jitter: uniform in [0, min(cap, base * 2**(attempt-1))]."""
    return random.uniform(0, min(cap, base * 2 ** max(0, attempt - 1)))


class Stage(StrEnum):
    """What failed: each stage has its own attempts and backoff."""
    SHARD = "shard"     # a shard's attempt (dispatch.run_lease; its end is `end_attempt`'s)
    STEP = "step"       # a job's lifecycle step: pinning, planning, running, verification and publish, cancelling
    PLAN = "plan"       # one input object's planning attempt (a planning task)
    CALL = "call"       # one ledger, store or broker call (`retrying`)


class Action(StrEnum):
    RETRY = "retry"             # try again after `delay` seconds
    ABANDON = "abandon"         # this attempt is over; another attempt owns the work (a lost lease)
    FAIL_JOB = "fail_job"       # no retry can fix it: the job fails now with `reason`
    GIVE_UP = "give_up"         # retryable, but the attempts or the job's budget are spent: fail with `reason`
    QUARANTINE = "quarantine"   # a shard's attempts kill their workers: isolate its records


@dataclass(frozen=True)
class Decision:
    action: Action
    delay: float = 0.0          # seconds before the retry (RETRY)
    reason: str = ""            # why the work fails (FAIL_JOB, GIVE_UP; for a shard: "" when its attempts ran out)


@dataclass(frozen=True)
class AttemptEnd:
    """What the ledger knows of a shard's attempts as the one holding it ends (this one included)."""
    attempt: int                # the ending attempt's number
    lost: bool                  # it lost its worker (else it raised)
    counts: bool                # it counts against the shard's records (failed, or lost while computing them)
    failed: int                 # attempts that raised
    charged_hosts: list[str]    # hosts of the lost attempts that count (their worker ran the records)
    lost_total: int             # attempts that lost their worker, counting or not
    fleet_hosts: int            # hosts that ran attempts lately (`live_host_seconds`)
    spent: int | None = None    # failed attempts of the job so far, this one included (a raised attempt)
    shards: int = 0             # shards of the job (the default budget)
    give_up: bool = False       # the worker's decision was FAIL_JOB: the shard fails now


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3                 # BATCHINF_MAX_ATTEMPTS: counted attempts per shard, planning attempts per object
    job_retry_budget: int = 0             # BATCHINF_JOB_RETRY_BUDGET: failed attempts per job; 0: max(10, shards)
    retry_elsewhere_seconds: float = 30.0  # BATCHINF_RETRY_ELSEWHERE_SECONDS
    max_step_failures: int = 10           # BATCHINF_MAX_STEP_FAILURES: consecutive failed steps of a job
    step_retry_cap: float = 60.0          # BATCHINF_STEP_RETRY_CAP
    step_retry_base: float = 0.5          # the first retry of a failed step waits up to this, doubling
    shard_retry_base: float = 1.0         # ... of a failed shard attempt
    shard_retry_cap: float = 30.0
    plan_retry_base: float = 2.0          # a failed planning attempt is sent again after base * 2**(attempts-1) s
    call_attempts: int = 10               # tries of one ledger or store call (`retrying`)
    call_retry_base: float = 0.2
    call_retry_cap: float = 5.0
    min_job_budget: int = 10              # the default budget is at least this
    lost_attempts_factor: int = 5         # lost attempts that never ran a record fail the shard past this × max_attempts
    live_host_seconds: float = 600.0      # a host that started, heartbeated or ended an attempt this recently is in the fleet
    elsewhere_countdown: float = 1.0      # a shard left to other hosts is offered again this much later

    @classmethod
    def from_settings(cls, **overrides: Any) -> RetryPolicy:
        """The policy of this process's settings, with `overrides` (tests, a stopping job)."""
        s = settings()
        return dataclasses.replace(cls(max_attempts=s.max_attempts, job_retry_budget=s.job_retry_budget,
                                       retry_elsewhere_seconds=s.retry_elsewhere_seconds,
                                       max_step_failures=s.max_step_failures, step_retry_cap=s.step_retry_cap),
                                   **overrides)

    def limit(self, stage: Stage) -> int:
        """Failures of one unit of work (a shard, an object, a step, a call) before it gives up."""
        return {Stage.SHARD: self.max_attempts, Stage.PLAN: self.max_attempts, Stage.STEP: self.max_step_failures,
                Stage.CALL: self.call_attempts}[stage]

    def backoff(self, stage: Stage, attempt: int) -> float:
        """Seconds before failure `attempt` (1 = the first) of the stage is retried."""
        if stage is Stage.PLAN:     # deterministic: the dispatcher caps it with its requeue interval
            return self.plan_retry_base * 2 ** max(0, attempt - 1)
        base, cap = {Stage.SHARD: (self.shard_retry_base, self.shard_retry_cap),
                     Stage.STEP: (self.step_retry_base, self.step_retry_cap),
                     Stage.CALL: (self.call_retry_base, self.call_retry_cap)}[stage]
        return compute_backoff(attempt, base=base, cap=cap)

    def job_budget(self, shards: int) -> int:
        return self.job_retry_budget if self.job_retry_budget > 0 else max(self.min_job_budget, shards)

    def decide(self, exc: BaseException | None, attempt: int, spent: int = 0, *, stage: Stage = Stage.SHARD,
               shards: int = 0) -> Decision:
        """What to do after failure number `attempt` of one unit of work of `stage`. `exc`: the
        exception (None: unknown, e.g. a planning attempt that timed out or lost its worker: retried);
        `spent`: for shards, failed attempts of the job so far, this one included (0: not counted);
        `shards`: the job's shards (its default budget)."""
        kind = Outcome.RETRY if exc is None else classify(exc)
        if kind is Outcome.FAIL_SHARD:
            return Decision(Action.ABANDON, reason=str(exc))
        if kind is Outcome.FAIL_JOB:
            return Decision(Action.FAIL_JOB, reason=f"failed: {exc}")
        last = "" if exc is None else f"; last error: {type(exc).__name__}: {exc}"
        if stage is Stage.SHARD and spent and spent > (budget := self.job_budget(shards)):
            return Decision(Action.GIVE_UP, reason=f"the job's retry budget is spent ({budget} failed attempts; "
                                                   f"set BATCHINF_JOB_RETRY_BUDGET to allow more)")
        if attempt >= self.limit(stage):
            what = "in a row" if stage is Stage.STEP else ""
            return Decision(Action.GIVE_UP, reason=f"failed {attempt} times{' ' + what if what else ''}{last}")
        return Decision(Action.RETRY, delay=self.backoff(stage, attempt))

    def end_attempt(self, end: AttemptEnd) -> Decision:
        """Where a shard goes as the attempt holding it ends: RETRY (after a backoff if the attempt
        counts), QUARANTINE or GIVE_UP (the shard, and its job, fail; `reason` "" when its
        attempts simply ran out).

        A failed attempt counts; a lost one counts only if its worker was running the shard's
        records, since a worker killed or stalled around them (downloading, loading the bundle,
        writing, committing) says nothing about them. Once `max_attempts` count: a shard whose
        counted attempts all lost their worker is quarantined (a record in it kills workers) if they
        ran on two hosts or more, or the fleet has one host; one killed on a single host of a larger
        fleet retries elsewhere (that host's infrastructure is the suspect); any failed attempt among
        them fails the shard. Lost attempts that did not count fail it only past
        `lost_attempts_factor` × max_attempts (a worker that dies before it computes, e.g. while loading).
        A raised attempt that spends the job's budget fails the shard: a storage outage then fails
        the job after a bounded number of retries instead of every shard retrying against it."""
        if end.give_up:
            return Decision(Action.GIVE_UP)
        if end.spent is not None and end.spent > (budget := self.job_budget(end.shards)):
            return Decision(Action.GIVE_UP, reason=f"the job's retry budget is spent ({budget} failed attempts; "
                                                   f"set BATCHINF_JOB_RETRY_BUDGET to allow more)")
        if end.failed + len(end.charged_hosts) >= self.max_attempts:
            if end.failed:
                return Decision(Action.GIVE_UP)
            if end.lost and len(set(end.charged_hosts)) >= min(2, end.fleet_hosts):
                return Decision(Action.QUARANTINE)
        if end.lost_total >= self.lost_attempts_factor * max(1, self.max_attempts):
            uncharged = end.lost_total - len(end.charged_hosts)
            return Decision(Action.GIVE_UP, reason=f"its worker was lost in {end.lost_total} attempts, {uncharged} "
                                                   "of them while not running records (loading the bundle, writing "
                                                   "or committing)")
        return Decision(Action.RETRY, delay=self.backoff(Stage.SHARD, end.attempt) if end.counts else 0.0)

    def retrying(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call fn, retrying TransientError (a ledger or store call) `call_attempts` times with a backoff."""
        for i in range(1, self.call_attempts + 1):
            try:
                return fn(*args, **kwargs)
            except TransientError as exc:
                decision = self.decide(exc, i, stage=Stage.CALL)
                if decision.action is not Action.RETRY:
                    raise
                time.sleep(decision.delay)
        raise AssertionError("unreachable")


def retrying(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`RetryPolicy.retrying` with this process's policy."""
    return RetryPolicy.from_settings().retrying(fn, *args, **kwargs)
