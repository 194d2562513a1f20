"""The retry policy as a table: (stage, exception kind, attempt, spent) -> decision, and a shard's
attempts as one ends -> retry / quarantine / give up. Settings come from the environment."""

from __future__ import annotations

import pytest

from batchinf.config import settings
from batchinf.errors import (BundleError, DeviceUnavailableError, InputError, StaleAttemptError, StoreError,
                             TransientError, VerificationError)
from batchinf.retry_policy import Action, AttemptEnd, RetryPolicy, Stage

POLICY = RetryPolicy(max_attempts=3, job_retry_budget=0, max_step_failures=10, step_retry_cap=60.0)


def _from_transient() -> VerificationError:
    try:
        raise TransientError("S3 503")
    except TransientError as exc:
        try:
            raise VerificationError("part cannot be read") from exc
        except VerificationError as outer:
            return outer


DECIDE = [
    # stage, exception, attempt, spent, shards -> action
    (Stage.SHARD, TransientError("S3 503"), 1, 0, 4, Action.RETRY),
    (Stage.SHARD, TransientError("S3 503"), 3, 0, 4, Action.GIVE_UP),            # max_attempts
    (Stage.SHARD, TransientError("S3 503"), 1, 10, 4, Action.RETRY),             # budget max(10, shards) = 10
    (Stage.SHARD, TransientError("S3 503"), 1, 11, 4, Action.GIVE_UP),           # ... spent
    (Stage.SHARD, TransientError("S3 503"), 1, 40, 50, Action.RETRY),            # budget = shards
    (Stage.SHARD, RuntimeError("unexpected"), 2, 0, 1, Action.RETRY),
    (Stage.SHARD, DeviceUnavailableError("no cuda"), 1, 0, 1, Action.RETRY),    # another worker may have it
    (Stage.SHARD, StaleAttemptError("lost its lease"), 1, 0, 1, Action.ABANDON),
    (Stage.SHARD, StaleAttemptError("lost its lease"), 9, 99, 1, Action.ABANDON),
    (Stage.SHARD, BundleError("bad bundle"), 1, 0, 1, Action.FAIL_JOB),
    (Stage.SHARD, InputError("bad line"), 1, 0, 1, Action.FAIL_JOB),
    (Stage.STEP, VerificationError("digest differs"), 1, 0, 0, Action.FAIL_JOB),
    (Stage.STEP, StoreError("AccessDenied"), 1, 0, 0, Action.FAIL_JOB),
    (Stage.STEP, _from_transient(), 1, 0, 0, Action.RETRY),                     # raised from a transient fault
    (Stage.STEP, TransientError("db restart"), 9, 0, 0, Action.RETRY),
    (Stage.STEP, TransientError("db restart"), 10, 0, 0, Action.GIVE_UP),       # max_step_failures
    (Stage.STEP, TransientError("db restart"), 10, 99, 0, Action.GIVE_UP),      # spent: shards only
    (Stage.PLAN, None, 2, 0, 0, Action.RETRY),                                  # timed out, worker died
    (Stage.PLAN, None, 3, 0, 0, Action.GIVE_UP),
    (Stage.CALL, TransientError("reset"), 9, 0, 0, Action.RETRY),
    (Stage.CALL, TransientError("reset"), 10, 0, 0, Action.GIVE_UP),
]


@pytest.mark.parametrize(("stage", "exc", "attempt", "spent", "shards", "action"), DECIDE)
def test_decide(stage: Stage, exc: BaseException | None, attempt: int, spent: int, shards: int,
                action: Action) -> None:
    assert POLICY.decide(exc, attempt, spent, stage=stage, shards=shards).action is action


def test_decisions_say_why_and_how_long() -> None:
    d = POLICY.decide(TransientError("db restart"), 10, stage=Stage.STEP)
    assert d.reason == "failed 10 times in a row; last error: TransientError: db restart"
    assert POLICY.decide(BundleError("bad"), 1, stage=Stage.STEP).reason == "failed: bad"
    budget = POLICY.decide(TransientError("x"), 1, 11, shards=4).reason
    assert "retry budget is spent (10 failed attempts; set BATCHINF_JOB_RETRY_BUDGET" in budget
    for attempt in (1, 2, 3, 8):                           # full jitter under the cap
        assert 0 <= POLICY.decide(TransientError("x"), attempt, stage=Stage.STEP).delay <= min(60.0, 0.5 * 2 ** (attempt - 1))
        assert 0 <= POLICY.backoff(Stage.SHARD, attempt) <= min(30.0, 2 ** (attempt - 1))
        assert 0 <= POLICY.backoff(Stage.CALL, attempt) <= min(5.0, 0.2 * 2 ** (attempt - 1))
    assert [POLICY.backoff(Stage.PLAN, a) for a in (1, 2, 3)] == [2.0, 4.0, 8.0]


def _end(**kw: object) -> AttemptEnd:
    base = {"attempt": 1, "lost": False, "counts": True, "failed": 0, "charged_hosts": [], "lost_total": 0,
            "fleet_hosts": 1}
    return AttemptEnd(**{**base, **kw})  # type: ignore[arg-type]


END = [
    # what the ledger knows as the holder ends -> action
    (_end(failed=1), Action.RETRY),
    (_end(attempt=3, failed=3), Action.GIVE_UP),                                        # max_attempts
    (_end(attempt=3, failed=1, lost=True, charged_hosts=["a", "b"], lost_total=2), Action.GIVE_UP),  # one raised
    (_end(attempt=3, lost=True, charged_hosts=["a", "a", "a"], lost_total=3, fleet_hosts=1), Action.QUARANTINE),
    (_end(attempt=3, lost=True, charged_hosts=["a", "a", "a"], lost_total=3, fleet_hosts=2), Action.RETRY),  # host's fault
    (_end(attempt=4, lost=True, charged_hosts=["a", "a", "a", "b"], lost_total=4, fleet_hosts=2), Action.QUARANTINE),
    (_end(attempt=14, lost=True, counts=False, lost_total=14), Action.RETRY),
    (_end(attempt=15, lost=True, counts=False, lost_total=15), Action.GIVE_UP),          # lost_attempts_factor x 3
    (_end(failed=1, spent=11, shards=4), Action.GIVE_UP),                              # the job's budget
    (_end(failed=1, spent=11, shards=20), Action.RETRY),
    (_end(failed=1, give_up=True), Action.GIVE_UP),                                    # the worker said FAIL_JOB
]


@pytest.mark.parametrize(("end", "action"), END)
def test_end_attempt(end: AttemptEnd, action: Action) -> None:
    assert POLICY.end_attempt(end).action is action


def test_end_attempt_backs_off_only_counted_attempts() -> None:
    assert POLICY.end_attempt(_end(lost=True, counts=False, lost_total=1)).delay == 0.0
    assert "while not running records" in POLICY.end_attempt(_end(attempt=15, lost=True, counts=False,
                                                                   lost_total=15)).reason


def test_settings_feed_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("BATCHINF_MAX_ATTEMPTS", "5"), ("BATCHINF_JOB_RETRY_BUDGET", "7"),
                        ("BATCHINF_RETRY_ELSEWHERE_SECONDS", "12"), ("BATCHINF_MAX_STEP_FAILURES", "4"),
                        ("BATCHINF_STEP_RETRY_CAP", "0")):
        monkeypatch.setenv(name, value)
    settings.cache_clear()
    try:
        p = RetryPolicy.from_settings()
        assert (p.max_attempts, p.job_retry_budget, p.retry_elsewhere_seconds, p.max_step_failures,
                p.step_retry_cap) == (5, 7, 12.0, 4, 0.0)
        assert p.backoff(Stage.STEP, 5) == 0.0                                  # a cap of 0: at once
        assert RetryPolicy.from_settings(max_attempts=2).max_attempts == 2
    finally:
        monkeypatch.undo()
        settings.cache_clear()
