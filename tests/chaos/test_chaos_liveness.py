"""Worker liveness in distributed mode (a controller and Celery workers as real processes, on the
shared PostgreSQL, Redis and S3 server): a pool process killed with SIGKILL releases its lease at
once (Celery's WorkerLostError, `workers.celery_app.ShardRequest`), attempts lost to killed
workers never quarantine healthy records and are swept; a bundle load slower than the lease does
not lose its attempt (the heartbeat runs from the claim); a retry leaves the host it failed on.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import func, select

from batchinf.ledger.db import tx
from batchinf.ledger.tables import attempts, shards
from tests.helpers.cluster import SLOW, Cluster, exactly_once, job, wait

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.slow]
SEEDS = range(int(os.environ.get("BATCHINF_CHAOS_SEEDS", "1")))


def _attempts(job_id: str) -> list:
    with tx() as conn:
        return conn.execute(select(attempts).join(shards, shards.c.id == attempts.c.shard_id)
                            .where(shards.c.job_id == job_id).order_by(attempts.c.shard_id, attempts.c.number)).all()


# A shard's holder is killed at most this often: past max_attempts (3), so released attempts must
# not count as failures, but short of the crash-loop cap (15 lost attempts fail a shard), which a
# storm faster than a slow machine's attempts would otherwise reach on the last shard.
KILLS_PER_SHARD = 6


def _random_lease_holder(rng: random.Random, killed: Counter) -> tuple[str, int] | None:
    """A shard and the pid of the pool process holding its lease now, drawn at random (a fault hits
    any worker), among shards killed fewer than KILLS_PER_SHARD times."""
    with tx() as conn:
        held = sorted(conn.execute(select(shards.c.id, shards.c.lease_owner).where(
            shards.c.status == "running", shards.c.lease_owner.is_not(None))).all())
    held = [(sid, owner) for sid, owner in held if killed[sid] < KILLS_PER_SHARD]
    if not held:
        return None
    sid, owner = rng.choice(held)
    return sid, int(owner.rsplit(":", 1)[1])


@pytest.mark.parametrize("seed", SEEDS)
def test_killed_workers_release_at_once_and_quarantine_nothing(seed: int, cluster: Cluster, tmp_path: Path,
                                                               s3_bucket: str) -> None:
    """A pool process holding a lease, drawn at random, is killed with SIGKILL every 2-4.5 s while
    a 12-shard job runs, under a 60 s lease and 3 attempts a shard: each kill releases its lease at
    once (the job could not finish in time otherwise), and the job ends `succeeded`, every record
    exactly once, no shard quarantined, every lost attempt swept."""
    rng = random.Random(f"kill-storm:{seed}")
    cluster.env["BATCHINF_LEASE_SECONDS"] = "60"          # expiry alone would stall the job a minute a kill
    cluster.env["BATCHINF_MAX_ATTEMPTS"] = "3"            # the default
    job_id, good = job(tmp_path, s3_bucket, n=288, max_records=24)
    cluster.controller()
    cluster.worker("w1", **SLOW)
    cluster.worker("w2", **SLOW)
    t0, kills, killed = time.monotonic(), 0, Counter()
    from batchinf.ledger.status import status

    while status(job_id)["status"] not in ("succeeded", "failed") and time.monotonic() - t0 < 150:
        time.sleep(rng.uniform(2.0, 4.5))   # about a restarted worker's attempt (2-3 s): progress is possible
        if (held := _random_lease_holder(rng, killed)) is not None:
            try:
                os.kill(held[1], signal.SIGKILL)
                kills += 1
                killed[held[0]] += 1
            except ProcessLookupError:
                pass
    wait(job_id, cluster, timeout=60)
    took = time.monotonic() - t0
    exactly_once(job_id, s3_bucket, good)                 # the 6 failed records are the bad ones: no poison row
    rows = _attempts(job_id)
    released = [a for a in rows if a.error and a.error.startswith("lease released (worker")]
    with tx() as conn:
        quarantined = conn.execute(select(func.count()).select_from(shards).where(
            shards.c.job_id == job_id, shards.c.status == "quarantined")).scalar()
    print(f"{kills} kills, {len(rows)} attempts, {len(released)} released at once "
          f"({sum(a.computing_at is not None for a in released)} while running records), "
          f"{sum(a.error is not None and 'stopped heartbeating' in a.error for a in rows)} by expiry, "
          f"most lost attempts of one shard {max(Counter(a.shard_id for a in released).values(), default=0)} "
          f"(3 quarantined it before), job done in {took:.1f} s")
    assert kills >= 3 and released, f"the scenario killed nothing that held a lease\n{cluster.log_tail()}"
    assert quarantined == 0
    assert sorted({a.status for a in rows}) in (["committed"], ["committed", "swept"])


def test_a_load_slower_than_the_lease_keeps_its_attempt(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    """Every attempt waits 6 s right after its claim, where the worker imports its runtime and loads
    the bundle (failpoint `execute.load`), under a 4 s lease: the heartbeat, started at the
    claim, keeps every attempt; none is lost."""
    job_id, good = job(tmp_path, s3_bucket, n=24, max_records=24)
    cluster.controller()
    cluster.worker("w1", BATCHINF_FAILPOINTS="execute.load=sleep(6)")
    wait(job_id, cluster, timeout=120)
    exactly_once(job_id, s3_bucket, good)
    rows = _attempts(job_id)
    assert len(rows) == 2 and {a.status for a in rows} == {"committed"}, [(a.status, a.error) for a in rows]


def test_a_retry_leaves_the_host_it_failed_on(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    """Every attempt on w1 fails (as a full scratch disk would); w2 is healthy. Each shard that
    failed on w1 is retried on w2, never twice on w1, and the job succeeds."""
    job_id, good = job(tmp_path, s3_bucket, n=240, max_records=24)
    cluster.controller()
    cluster.worker("w2", BATCHINF_FAILPOINTS="execute.after_write=sleep(1.0)")    # slow: w1 gets work too
    wait(job_id, cluster, until=lambda s: s["shards"]["running"] + s["shards"]["committed"] >= 1)  # w2 has an attempt
    cluster.worker("w1", BATCHINF_FAILPOINTS="execute.before_commit=raise")
    wait(job_id, cluster, timeout=120)
    exactly_once(job_id, s3_bucket, good)
    rows = _attempts(job_id)
    failed = [a for a in rows if a.error and "failpoint execute.before_commit raised" in a.error]
    assert failed, f"w1 ran no attempt\n{cluster.log_tail()}"
    assert {a.host.split("@")[0] for a in failed} == {"w1"}
    by_shard: dict[str, list] = {}
    for a in rows:
        by_shard.setdefault(a.shard_id, []).append(a)
    print("attempts' hosts per shard:", sorted(" ".join(a.host.split("@")[0] for a in runs) for runs in by_shard.values()))
    for runs in by_shard.values():
        hosts = [a.host.split("@")[0] for a in runs]
        assert "w1w1" not in "".join(hosts), hosts      # a retry never went back to the host that failed it
        assert hosts[-1] == "w2"
