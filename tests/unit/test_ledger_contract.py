"""One ledger contract, run on SQLite and PostgreSQL (schema built by Alembic)."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, insert, select, update

from batchinf.errors import StaleAttemptError
from batchinf.ledger import leases as lease_repo
from batchinf.ledger import shards as shard_repo
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import models
from batchinf.ledger import events
from batchinf.ledger.db import tx
from batchinf.retry import retrying
from batchinf.ledger.states import (
    ATTEMPT_LOSERS,
    ATTEMPT_TRANSITIONS,
    JOB_ACTIVE,
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    SHARD_TERMINAL,
    SHARD_TRANSITIONS,
    AttemptStatus,
    JobStatus,
    ShardStatus,
)
from batchinf.ledger.tables import attempts, bundles, job_events, jobs, shards


def test_state_groups_cover_the_enums() -> None:
    assert set(JOB_TRANSITIONS) == set(JobStatus)
    assert set(SHARD_TRANSITIONS) == set(ShardStatus)
    assert set(ATTEMPT_TRANSITIONS) == set(AttemptStatus)
    assert all(AttemptStatus.SWEPT in ATTEMPT_TRANSITIONS[s] for s in ATTEMPT_LOSERS)
    assert not ATTEMPT_TRANSITIONS[AttemptStatus.COMMITTED]      # a winner never changes outcome
    assert JOB_ACTIVE | JOB_TERMINAL == set(JobStatus) and not JOB_ACTIVE & JOB_TERMINAL
    assert all(not JOB_TRANSITIONS[s] for s in JOB_TERMINAL)
    assert all(not SHARD_TRANSITIONS[s] for s in SHARD_TERMINAL)
    for s in JOB_ACTIVE:   # any non-final state can fail, be cancelled or expire
        assert {JobStatus.FAILED, JobStatus.EXPIRED} <= JOB_TRANSITIONS[s]
        assert s is JobStatus.CANCELLING or JobStatus.CANCELLING in JOB_TRANSITIONS[s]


def _job(n_shards: int = 3, job_id: str = "job-1") -> str:
    t = events.now()
    with tx() as conn:
        if conn.execute(select(bundles.c.digest)).first() is None:
            conn.execute(insert(bundles).values(digest="sha256:" + "0" * 64, name="b", uri="file:///b",
                                                task="embed", family="bert", meta="{}", created_at=t))
        conn.execute(insert(jobs).values(
            id=job_id, tenant="default", name="t", status="running", task="embed", manifest="{}",
            bundle_ref="b", bundle_digest="sha256:" + "0" * 64, input_uri="file:///in",
            output_uri="file:///out/", work_uri="file:///out/_work/", priority=0, created_at=t, updated_at=t))
        conn.execute(insert(shards), [
            {"id": f"{job_id}-s{i}", "job_id": job_id, "bucket": 0, "ordinal": i, "status": "pending",
             "attempt": 0, "num_records": 1, "num_tokens": 1, "input_uri": "file:///x", "updated_at": t}
            for i in range(n_shards)])
    return job_id


def _result() -> models.ShardResult:
    return models.ShardResult("file:///o", "a" * 64, 1, "file:///e", "b" * 64, 0, 5, 0, 5, 8, 0.1, [])


def test_job_transitions_follow_the_table(ledger: str) -> None:
    job_id = _job()
    with tx() as conn:
        assert not job_repo.transition(conn, job_id, JobStatus.SUCCEEDED)   # running -/-> succeeded
        assert job_repo.transition(conn, job_id, JobStatus.VERIFYING)
        assert job_repo.transition(conn, job_id, JobStatus.SUCCEEDED)
        assert not job_repo.transition(conn, job_id, JobStatus.FAILED)      # terminal stays terminal
        events = conn.execute(select(job_events.c.from_status, job_events.c.to_status)
                              .where(job_events.c.kind == "job")).all()
    assert [tuple(e) for e in events] == [("running", "verifying"), ("verifying", "succeeded")]


def test_claim_heartbeat_commit_with_fencing(ledger: str) -> None:
    job_id = _job(n_shards=2)
    assert lease_repo.claim_next([job_id], "w:1", 30) is None                   # nothing queued yet
    assert len(shard_repo.dispatch_ready(job_id)) == 2
    a = lease_repo.claim_next([job_id], "w:1", 30)
    b = lease_repo.claim_next([job_id], "w:2", 30)
    assert a and b and a.shard_id != b.shard_id and a.attempt == b.attempt == 1
    assert lease_repo.claim_next([job_id], "w:3", 30) is None
    assert lease_repo.claim_shard(a.shard_id, "w:3", 30) is None                # duplicate delivery
    assert lease_repo.heartbeat(a, 30)
    lease_repo.commit_attempt(a, _result())
    with pytest.raises(StaleAttemptError):
        lease_repo.commit_attempt(a, _result())                                 # commits once
    with tx() as conn:
        row = conn.execute(select(shards).where(shards.c.id == a.shard_id)).one()
        att = conn.execute(select(attempts.c.status).where(attempts.c.shard_id == a.shard_id)).scalars().all()
    assert row.status == "committed" and row.output_sha256 == "a" * 64 and att == ["committed"]


def _claim_again(job_id: str, attempt: int) -> models.Lease:
    shard_repo.dispatch_ready(job_id)
    with tx() as conn:   # skip backoff
        conn.execute(update(shards).values(not_before=0))
    shard_repo.dispatch_ready(job_id)
    lease = lease_repo.claim_next([job_id], "w:1", 30)
    assert lease is not None and lease.attempt == attempt
    return lease


def test_lost_leases_retry_then_quarantine(ledger: str) -> None:
    """Every attempt lost its worker: after the bounded attempts the shard is quarantined (for
    poison isolation), and the job keeps running."""
    job_id = _job(n_shards=1)
    for attempt in (1, 2):
        lease = _claim_again(job_id, attempt)
        with tx() as conn:
            conn.execute(update(shards).values(lease_expires_at=0))
        assert lease_repo.expire_leases(job_id, max_attempts=2) == 1
        assert not lease_repo.heartbeat(lease, 30)
    with tx() as conn:
        assert conn.execute(select(shards.c.status)).scalar() == "quarantined"
        assert conn.execute(select(jobs.c.status)).scalar() == "running"


def test_raising_attempts_fail_the_shard_and_job(ledger: str) -> None:
    job_id = _job(n_shards=1)
    for attempt in (1, 2):
        lease = _claim_again(job_id, attempt)
        lease_repo.fail_attempt(lease, "OSError: disk full", max_attempts=2)
    with tx() as conn:
        assert conn.execute(select(shards.c.status)).scalar() == "failed"
        assert conn.execute(select(jobs.c.status)).scalar() == "failed"
        assert "failed 2 attempts" in conn.execute(select(jobs.c.error)).scalar()


def test_concurrent_claims_never_share_a_shard(ledger: str) -> None:
    job_id = _job(n_shards=20)
    shard_repo.dispatch_ready(job_id)
    got: list[str] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        while (lease := retrying(lease_repo.claim_next, [job_id], f"w:{n}", 30)) is not None:
            with lock:
                got.append(lease.shard_id)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == sorted(f"{job_id}-s{i}" for i in range(20))
    with tx() as conn:
        assert conn.execute(select(func.count()).select_from(attempts)).scalar() == 20


def test_nothing_commits_after_cancel(ledger: str) -> None:
    job_id = _job(n_shards=2)
    shard_repo.dispatch_ready(job_id)
    lease = lease_repo.claim_next([job_id], "w:1", 30)
    assert lease is not None and lease_repo.leases_held(job_id) == 1
    assert job_repo.request_cancel(job_id, "cancelled by request")
    assert not job_repo.request_cancel(job_id, "again")            # cancelling -/-> cancelling
    assert not lease_repo.heartbeat(lease, 30)                       # the worker learns at its heartbeat
    with pytest.raises(StaleAttemptError):
        lease_repo.commit_attempt(lease, _result())
    assert lease_repo.claim_next([job_id], "w:2", 30) is None        # nothing new starts
    lease_repo.release_leases(job_id)
    with tx() as conn:
        assert conn.execute(select(shards.c.status).where(shards.c.id == lease.shard_id)).scalar() == "retrying"
        assert conn.execute(select(jobs.c.status)).scalar() == "cancelling"


def _committed(job_id: str, lease: models.Lease, seconds: float) -> None:
    lease_repo.commit_attempt(lease, models.ShardResult("file:///o", "a" * 64, 1, "file:///e", "b" * 64, 0,
                                              5, 0, 5, 8, seconds, []))


def _straggling_job() -> tuple[str, models.Lease]:
    """Four shards: three commit in ~1 s, the fourth's attempt has run for 100 s."""
    job_id = _job(n_shards=4)
    shard_repo.dispatch_ready(job_id)
    leases = [lease_repo.claim_next([job_id], "w:1", 300) for _ in range(4)]
    for lease in leases[:3]:
        _committed(job_id, lease, 1.0)
    slow = leases[3]
    with tx() as conn:
        conn.execute(update(attempts).where(attempts.c.shard_id == slow.shard_id).values(started_at=events.now() - 100))
    return job_id, slow


def test_stragglers_get_one_speculative_attempt_on_another_worker(ledger: str) -> None:
    job_id, slow = _straggling_job()
    assert shard_repo.stragglers(job_id, factor=3, min_seconds=1000) == []      # not slow enough yet
    assert shard_repo.stragglers(job_id, factor=3, min_seconds=5) == [slow.shard_id]
    assert lease_repo.claim_speculative(slow.shard_id, "w:1") is None            # not on the same worker
    twin = lease_repo.claim_speculative(slow.shard_id, "w:2")
    assert twin is not None and twin.attempt == slow.attempt + 1
    assert lease_repo.claim_speculative(slow.shard_id, "w:3") is None            # one twin at most
    assert shard_repo.stragglers(job_id, factor=3, min_seconds=5) == []
    assert lease_repo.heartbeat(slow, 30) and lease_repo.heartbeat(twin, 30)
    _committed(job_id, twin, 2.0)                                         # the twin wins
    assert not lease_repo.heartbeat(slow, 30)                                    # the original stops...
    with pytest.raises(StaleAttemptError):
        _committed(job_id, slow, 100.0)                                   # ...and can never commit
    with tx() as conn:
        row = conn.execute(select(shards).where(shards.c.id == slow.shard_id)).one()
        st = dict(conn.execute(select(attempts.c.number, attempts.c.status)
                               .where(attempts.c.shard_id == slow.shard_id)).all())
    assert row.status == "committed" and row.attempt == twin.attempt
    assert st == {slow.attempt: "superseded", twin.attempt: "committed"}


def test_the_original_may_still_win(ledger: str) -> None:
    job_id, slow = _straggling_job()
    twin = lease_repo.claim_speculative(slow.shard_id, "w:2")
    _committed(job_id, slow, 100.0)                                       # first commit wins
    assert not lease_repo.heartbeat(twin, 30)
    with pytest.raises(StaleAttemptError):
        _committed(job_id, twin, 1.0)


def test_lost_original_hands_the_shard_to_its_live_twin(ledger: str) -> None:
    job_id, slow = _straggling_job()
    twin = lease_repo.claim_speculative(slow.shard_id, "w:2")
    with tx() as conn:
        conn.execute(update(shards).where(shards.c.id == slow.shard_id).values(lease_expires_at=0))
    assert lease_repo.expire_leases(job_id, max_attempts=3) == 1
    with tx() as conn:
        row = conn.execute(select(shards).where(shards.c.id == slow.shard_id)).one()
    assert row.status == "running" and row.attempt == twin.attempt and row.lease_owner == "w:2"
    assert not lease_repo.heartbeat(slow, 30) and lease_repo.heartbeat(twin, 30)
    _committed(job_id, twin, 2.0)


def test_a_silent_twin_is_lost_and_the_original_carries_on(ledger: str) -> None:
    job_id, slow = _straggling_job()
    twin = lease_repo.claim_speculative(slow.shard_id, "w:2")
    with tx() as conn:
        conn.execute(update(attempts).where(attempts.c.shard_id == twin.shard_id,
                                            attempts.c.number == twin.attempt).values(heartbeat_at=0))
    assert lease_repo.expire_leases(job_id, max_attempts=3) == 0
    assert not lease_repo.heartbeat(twin, 30) and lease_repo.heartbeat(slow, 30)
    _committed(job_id, slow, 100.0)


def test_job_retry_budget_bounds_retries_across_shards(ledger: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shard may retry, but a job whose attempts keep raising (a storage outage) fails once
    its budget is spent, naming it, instead of retrying every shard against the outage."""
    from batchinf.config import settings

    monkeypatch.setenv("BATCHINF_JOB_RETRY_BUDGET", "3")
    settings.cache_clear()
    job_id = _job(n_shards=5)
    shard_repo.dispatch_ready(job_id)
    for n in range(4):
        lease = lease_repo.claim_next([job_id], "w:1", 30)
        assert lease is not None
        lease_repo.fail_attempt(lease, "TransientError: S3 503 SlowDown", max_attempts=10)
    with tx() as conn:
        job = conn.execute(select(jobs.c.status, jobs.c.error)).one()
    assert job.status == "failed" and "retry budget is spent (3 failed attempts" in job.error
    settings.cache_clear()


def test_dispatch_demand_counts_ready_and_in_flight(ledger: str) -> None:
    job_id = _job(n_shards=5)
    shard_repo.dispatch_ready(job_id, limit=2)
    assert lease_repo.claim_next([job_id], "w:1", 30) is not None
    (d,) = shard_repo.dispatch_demand()
    assert (d.job_id, d.in_flight, d.ready, d.priority) == (job_id, 2, 3, 0)
