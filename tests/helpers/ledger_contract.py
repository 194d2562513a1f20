"""One ledger contract, defined once and run on each backend (schema built by Alembic): on the
embedded SQLite ledger by tests/unit/test_ledger_contract_sqlite.py, on PostgreSQL by
tests/integration/test_ledger_contract_postgres.py. Each of them collects these tests with
`from tests.helpers.ledger_contract import *` and provides two fixtures:

    ledger          the database url of a ledger at head, which this process uses (BATCHINF_DATABASE_URL
                    or the embedded default), in a fresh BATCHINF_HOME
    empty_database  the url of a fresh, empty database of the same backend (migrations)
"""

from __future__ import annotations

import hashlib
import threading

import pytest
from sqlalchemy import create_engine, func, insert, inspect, select, update

from batchinf import tenants
from batchinf.config import settings
from batchinf.errors import LedgerError, StaleAttemptError
from batchinf.ledger import db
from batchinf.ledger import leases as lease_repo
from batchinf.ledger import shards as shard_repo
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import models
from batchinf.ledger import events
from batchinf.ledger import splits
from batchinf.ledger.db import tx
from batchinf.retry_policy import retrying
from batchinf.ledger.states import JobStatus
from batchinf.ledger.tables import api_tokens, attempts, bundles, job_events, jobs, shards
from batchinf.retry_policy import RetryPolicy


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


def _claim_again(job_id: str, attempt: int, worker: str = "w:1", host: str | None = None) -> models.Lease:
    shard_repo.dispatch_ready(job_id)
    with tx() as conn:   # skip backoff
        conn.execute(update(shards).values(not_before=0))
    shard_repo.dispatch_ready(job_id)
    lease = lease_repo.claim_next([job_id], worker, 30, host)
    assert lease is not None and lease.attempt == attempt
    return lease


def _shard_status(job_id: str, ordinal: int = 0) -> str:
    with tx() as conn:
        return conn.execute(select(shards.c.status).where(shards.c.id == f"{job_id}-s{ordinal}")).scalar()


def test_lost_leases_retry_then_quarantine(ledger: str) -> None:
    """Every attempt lost its worker while running the shard's records: after the bounded attempts
    the shard is quarantined (for poison isolation), and the job keeps running."""
    job_id = _job(n_shards=1)
    for attempt in (1, 2):
        lease = _claim_again(job_id, attempt)
        lease_repo.computing(lease, True)
        with tx() as conn:
            conn.execute(update(shards).values(lease_expires_at=0))
        assert lease_repo.expire_leases(job_id, RetryPolicy.from_settings(max_attempts=2)) == 1
        assert not lease_repo.heartbeat(lease, 30)
    with tx() as conn:
        assert conn.execute(select(shards.c.status)).scalar() == "quarantined"
        assert conn.execute(select(jobs.c.status)).scalar() == "running"


def test_workers_lost_outside_the_records_do_not_quarantine(ledger: str) -> None:
    """Attempts whose worker died while loading or writing (not running records) are
    infrastructure: they retry without backoff, never quarantine the shard, and fail it only
    past `RetryPolicy.lost_attempts_factor` x max_attempts, saying so."""
    job_id = _job(n_shards=1)
    cap = RetryPolicy().lost_attempts_factor * settings().max_attempts
    for attempt in range(1, cap + 1):
        lease = _claim_again(job_id, attempt)
        if attempt == 1:                          # it ran records, then stopped: not while it died
            lease_repo.computing(lease, True)
            lease_repo.computing(lease, False)
        assert lease_repo.release_dead(["w:1"], "signal 9 (SIGKILL)") == 1
        if attempt < cap:
            assert _shard_status(job_id) == "retrying"
            with tx() as conn:
                assert conn.execute(select(shards.c.not_before)).scalar() <= events.now()
    assert _shard_status(job_id) == "failed"
    with tx() as conn:
        error = conn.execute(select(jobs.c.error)).scalar()
        lost = conn.execute(select(attempts.c.error).where(attempts.c.number == 1)).scalar()
    assert f"lost in {cap} attempts, {cap} of them while not running records" in error
    assert lost == "lease released (worker w:1 died: signal 9 (SIGKILL))"


def test_workers_killed_on_one_host_of_two_do_not_quarantine(ledger: str) -> None:
    """Lost attempts that ran the records on one host of a fleet of two are that host's fault:
    the shard retries; once they span two hosts, the records are the suspects: quarantined."""
    job_id = _job(n_shards=2)
    shard_repo.dispatch_ready(job_id)
    other = lease_repo.claim_next([job_id], "b:7", 30, "node-b")        # node-b is in the fleet (s0)
    for attempt in (1, 2, 3):
        lease = _claim_again(job_id, attempt, "a:1", "node-a")
        lease_repo.computing(lease, True)
        lease_repo.release_dead(["a:1"], "signal 9 (SIGKILL)")
        assert _shard_status(job_id, 1) == "retrying", attempt
    for_30s = RetryPolicy.from_settings(retry_elsewhere_seconds=30)
    assert lease_repo.retry_elsewhere(lease.shard_id, "node-a", for_30s)
    assert not lease_repo.retry_elsewhere(lease.shard_id, "node-b", for_30s)
    not_at_all = RetryPolicy.from_settings(retry_elsewhere_seconds=0)
    assert not lease_repo.retry_elsewhere(lease.shard_id, "node-a", not_at_all)  # not for longer than asked
    lease_repo.commit_attempt(other, _result())
    lease = _claim_again(job_id, 4, "b:8", "node-b")
    lease_repo.computing(lease, True)
    lease_repo.release_dead(["b:8"], "signal 11 (SIGSEGV)")
    assert _shard_status(job_id, 1) == "quarantined"


def test_a_failure_on_the_only_host_retries_there(ledger: str) -> None:
    job_id = _job(n_shards=1)
    lease = _claim_again(job_id, 1, "a:1", "node-a")
    lease_repo.fail_attempt(lease, "OSError: [Errno 28] No space left on device", RetryPolicy.from_settings(max_attempts=3))
    for_30s = RetryPolicy.from_settings(retry_elsewhere_seconds=30)
    assert not lease_repo.retry_elsewhere(lease.shard_id, "node-a", for_30s)  # no other host was seen
    with tx() as conn:
        assert conn.execute(select(attempts.c.host)).scalar() == "node-a"


def test_raising_attempts_fail_the_shard_and_job(ledger: str) -> None:
    job_id = _job(n_shards=1)
    for attempt in (1, 2):
        lease = _claim_again(job_id, attempt)
        lease_repo.fail_attempt(lease, "OSError: disk full", RetryPolicy.from_settings(max_attempts=2))
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


def test_a_cancel_keeps_what_running_attempts_finish_then_nothing_commits(ledger: str) -> None:
    job_id = _job(n_shards=3)
    shard_repo.dispatch_ready(job_id)
    done, stopped = lease_repo.claim_next([job_id], "w:1", 30), lease_repo.claim_next([job_id], "w:2", 30)
    assert done is not None and stopped is not None and lease_repo.leases_held(job_id) == 2
    assert job_repo.request_cancel(job_id, "cancelled by request")
    assert not job_repo.request_cancel(job_id, "again")            # cancelling -/-> cancelling
    assert splits.wanted(done) == splits.STOP                       # the worker learns at its next batch,
    assert lease_repo.heartbeat(done, 30)                           # keeps its lease while it stops,
    lease_repo.commit_attempt(done, _result())                      # and what it finished is kept
    assert lease_repo.claim_next([job_id], "w:3", 30) is None        # nothing new starts
    lease_repo.release_leases(job_id)                               # the job stops: the rest is given back
    with pytest.raises(StaleAttemptError):
        lease_repo.commit_attempt(stopped, _result())
    assert not lease_repo.heartbeat(stopped, 30)
    with tx() as conn:
        shard_of = dict(conn.execute(select(shards.c.id, shards.c.status)).all())
        attempt_of = dict(conn.execute(select(attempts.c.shard_id, attempts.c.status)).all())
        assert conn.execute(select(jobs.c.status)).scalar() == "cancelling"
    assert (shard_of[done.shard_id], shard_of[stopped.shard_id]) == ("committed", "retrying")
    assert (attempt_of[done.shard_id], attempt_of[stopped.shard_id]) == ("committed", "released")


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
    assert lease_repo.expire_leases(job_id, RetryPolicy.from_settings(max_attempts=3)) == 1
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
    assert lease_repo.expire_leases(job_id, RetryPolicy.from_settings(max_attempts=3)) == 0
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
        lease_repo.fail_attempt(lease, "TransientError: S3 503 SlowDown", RetryPolicy.from_settings(max_attempts=10))
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


def test_dispatch_is_in_bucket_order_and_failed_records_are_counted_as_shards_commit(ledger: str) -> None:
    """dispatch_ready's bulk transition keeps the dispatch order (highest bucket first, then
    ordinal) and writes one event per shard; the job's failed-records counter (what the error
    budget reads each tick) equals the aggregate over its shards."""
    from dataclasses import replace

    job_id = _job(n_shards=4)
    with tx() as conn:
        conn.execute(update(shards).where(shards.c.id == f"{job_id}-s3").values(bucket=-1, num_records=7))
        conn.execute(update(jobs).where(jobs.c.id == job_id).values(error_records=7))   # as planning counts
    assert shard_repo.dispatch_ready(job_id, limit=3) == [f"{job_id}-s0", f"{job_id}-s1", f"{job_id}-s2"]
    with tx() as conn:
        assert conn.execute(select(func.count()).select_from(job_events).where(
            job_events.c.job_id == job_id, job_events.c.to_status == "queued")).scalar() == 3
    lease = lease_repo.claim_next([job_id], "w:1", 30)
    lease_repo.commit_attempt(lease, replace(_result(), error_rows=2))
    assert shard_repo.failed_records(job_id) == 7 + 2
    assert shard_repo.dispatch_ready(job_id) == [f"{job_id}-s3"]
    lease = lease_repo.claim_next([job_id], "w:1", 30)
    while lease.shard_id != f"{job_id}-s3":
        lease_repo.commit_attempt(lease, _result())
        lease = lease_repo.claim_next([job_id], "w:1", 30)
    lease_repo.commit_attempt(lease, replace(_result(), error_rows=7))    # counted at planning already
    assert shard_repo.failed_records(job_id) == 9


# --- migration 0004 (API tokens, schedule runs) and hashed tokens ----------------------------------


def test_migration_0004_up_down_up(empty_database: str) -> None:
    from alembic import command

    url = empty_database
    assert db.upgrade(url, "0003") == "0003"
    sa_url = url.replace("postgresql://", "postgresql+psycopg://")   # SQLAlchemy's driver; SQLite as is

    def tables() -> set[str]:
        eng = create_engine(sa_url)
        try:
            insp = inspect(eng)
            names = set(insp.get_table_names())
            cols = {c["name"] for c in insp.get_columns("schedules")}
        finally:
            eng.dispose()
        return names | {f"schedules.{c}" for c in cols}

    assert not {"api_tokens", "schedule_runs", "schedules.start_at"} & tables()
    assert db.upgrade(url, "0004") == "0004"
    assert {"api_tokens", "schedule_runs", "schedules.start_at"} <= tables()
    command.downgrade(db.alembic_config(sa_url), "0003")
    assert not {"api_tokens", "schedule_runs", "schedules.start_at"} & tables()
    assert db.upgrade(url, "0004") == "0004"


def test_tokens_are_stored_hashed_and_revocable(ledger: str) -> None:
    made = tenants.create_token("acme", name="ci")
    token = made["token"]
    assert token.startswith("bi_") and len(token) > 40
    with tx() as conn:
        rows = [dict(r._mapping) for r in conn.execute(select(api_tokens)).all()]
    assert len(rows) == 1
    assert rows[0]["token_sha256"] == hashlib.sha256(token.encode()).hexdigest()
    assert not any(token in str(v) for v in rows[0].values())    # never the token itself
    assert tenants.authenticate(token) == "acme"
    assert tenants.authenticate(token + "x") is None
    assert tenants.authenticate("Bearer " + token) is None
    listed = tenants.list_tokens("acme")
    assert [t["id"] for t in listed] == [made["id"]] and "token" not in listed[0]
    assert listed[0]["last_used_at"] is not None
    assert tenants.revoke_token(made["id"])["changed"]
    assert tenants.authenticate(token) is None
    assert not tenants.revoke_token(made["id"])["changed"]
    with pytest.raises(LedgerError, match="no token 'tok-nope'"):
        tenants.revoke_token("tok-nope")
    with pytest.raises(LedgerError, match="not a valid name"):
        tenants.create_token("bad tenant!")




# --- tallies: the totals status, the error budget and metrics read ---------------------------------


def _recount(job_id: str) -> dict:
    """The job's totals computed the slow way, from every row."""
    from batchinf.ledger.tables import record_errors

    with tx() as conn:
        by_status = dict(conn.execute(select(shards.c.status, func.count()).where(shards.c.job_id == job_id)
                                      .group_by(shards.c.status)).all())
        committed = conn.execute(select(*(func.coalesce(func.sum(c), 0) for c in (
            shards.c.num_records, shards.c.output_rows, shards.c.error_rows, shards.c.tokens_input,
            shards.c.tokens_real, shards.c.tokens_padded))).where(
            shards.c.job_id == job_id, shards.c.status == "committed")).one()
        computed_errors = conn.execute(select(func.coalesce(func.sum(shards.c.error_rows), 0)).where(
            shards.c.job_id == job_id, shards.c.bucket >= 0)).scalar()
        codes = dict(conn.execute(select(record_errors.c.error, func.count()).where(record_errors.c.job_id == job_id)
                                  .group_by(record_errors.c.error)).all())
        seconds = conn.execute(select(func.coalesce(func.sum(attempts.c.finished_at - attempts.c.started_at), 0.0))
                               .join(shards, shards.c.id == attempts.c.shard_id)
                               .where(shards.c.job_id == job_id, attempts.c.finished_at.is_not(None))).scalar()
    return {"shards": by_status, "committed": tuple(int(v) for v in committed), "computed_errors": int(computed_errors),
            "codes": codes, "seconds": round(float(seconds), 6)}


def _tallied(job_id: str) -> dict:
    from batchinf.ledger import tallies

    t = tallies.of_job(job_id)
    c = t.shard_sums("committed")
    return {"shards": {st: x.n for st, x in t.shards.items() if x.n},
            "committed": (c.records, c.output_rows, c.error_rows, c.tokens_input, c.tokens_real, c.tokens_padded),
            "computed_errors": t.computed_errors, "codes": t.errors_by_code, "seconds": round(t.worker_seconds, 6)}


def test_tallies_equal_a_recount_through_every_kind_of_transition(ledger: str) -> None:
    """Claims, commits with error rows, failures, lost leases, a speculative twin, a split, a
    poison record, a shard moved to the error bucket and a cancel: after each, the triggers'
    totals (before and after the tick folds them) equal a count over every row."""
    from dataclasses import replace

    from batchinf.ledger import splits, tallies

    job_id = _job(n_shards=6)
    other = _job(n_shards=2, job_id="job-2")      # another job's rows never leak into this one's

    def check() -> None:
        assert _tallied(job_id) == _recount(job_id)
        tallies.compact(job_id)
        assert _tallied(job_id) == _recount(job_id)
        assert _tallied(other) == _recount(other)

    check()
    shard_repo.dispatch_ready(job_id)
    shard_repo.dispatch_ready(other)
    check()
    errors = [{"record_id": f"r{i}", "source": "file:///in/a.jsonl", "ordinal": i, "error": code,
               "message": "bad", "attempts": 1} for i, code in enumerate(["inference_error", "too_long"])]
    a = lease_repo.claim_next([job_id], "w:1", 30)
    lease_repo.commit_attempt(a, replace(_result(), error_rows=2, errors=errors))
    b = lease_repo.claim_next([job_id], "w:1", 30)
    lease_repo.fail_attempt(b, "OSError: disk full", RetryPolicy.from_settings(max_attempts=3))
    c = lease_repo.claim_next([job_id], "w:2", 30)
    with tx() as conn:
        conn.execute(update(shards).where(shards.c.id == c.shard_id).values(lease_expires_at=0))
    assert lease_repo.expire_leases(job_id, RetryPolicy.from_settings(max_attempts=3)) == 1
    check()
    d = lease_repo.claim_next([job_id], "w:1", 30)
    twin = lease_repo.claim_speculative(d.shard_id, "w:9")
    assert twin is not None
    lease_repo.commit_attempt(twin, _result())                 # the twin wins; d is superseded
    e = lease_repo.claim_next([job_id], "w:1", 30)
    with tx() as conn:
        conn.execute(update(shards).where(shards.c.id == e.shard_id).values(num_records=5, num_tokens=50))
    splits.commit_split(e, replace(_result(), output_rows=2), 2, 20,
                        [{"id": f"{e.shard_id}-c0", "num_records": 3, "num_tokens": 30, "input_uri": "file:///c"}])
    check()
    with tx() as conn:
        conn.execute(update(shards).where(shards.c.id == f"{job_id}-s5").values(bucket=-1, status="quarantined"))
    shard_repo.record_poison(shard_repo.get(f"{job_id}-s5"), dict(errors[0], error="poison"), "file:///p", "c" * 64)
    check()
    assert shard_repo.failed_records(job_id) == 2          # s5 moved to the error bucket: planning's count
    lease_repo.commit_attempt(lease_repo.claim_next([other], "w:3", 30), _result())
    assert job_repo.request_cancel(job_id, "test")
    lease_repo.release_leases(job_id)
    check()
    final = _recount(job_id)
    assert final["codes"] == {"inference_error": 1, "too_long": 1, "poison": 1}
    with tx() as conn:          # what /metrics reads: every job's errors by code
        assert dict(tallies.errors_by_code(conn)) == final["codes"]
    assert final["shards"]["committed"] == 3 and final["committed"][2] == 2



def test_a_record_is_poisoned_once(ledger: str) -> None:
    """Two pieces of one record, each quarantined alone: the first resolves with the record's
    poison row, the second with none (and is refused the row it claims when the first holds it)."""
    job_id = _job(n_shards=2, job_id="job-p")
    with tx() as conn:
        conn.execute(update(shards).where(shards.c.job_id == job_id).values(status="quarantined"))
    first, second = (shard_repo.get(f"{job_id}-s{i}") for i in (0, 1))
    row = {"record_id": "long.wav", "source": "file:///in/long.wav", "ordinal": 0, "error": "poison",
           "message": "killed", "attempts": 1}
    assert not shard_repo.poisoned(job_id, row["source"], 0)
    assert not shard_repo.record_poison(first, row, "file:///p0", "a" * 64, first=False)   # no first row yet
    assert shard_repo.record_poison(first, row, "file:///p0", "a" * 64)
    assert shard_repo.poisoned(job_id, row["source"], 0)
    assert not shard_repo.record_poison(second, row, "file:///p1", "b" * 64)                # it would be twice
    assert shard_repo.record_poison(second, row, "file:///p1", "b" * 64, first=False)
    assert not shard_repo.record_poison(second, row, "file:///p1", "b" * 64, first=False)  # resolved once
    assert [(s.id, s.error_rows) for s in shard_repo.of_job(job_id)] == [(first.id, 1), (second.id, 0)]
    assert _recount(job_id)["codes"] == {"poison": 1}

__all__ = [name for name in list(globals()) if name.startswith("test_")]   # in definition order
