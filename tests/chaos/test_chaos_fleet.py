"""Chaos in distributed mode: a controller and two Celery workers as real processes, with a
private PostgreSQL and Redis that the scenario may restart, faults at a seeded moment. Every
scenario must end `succeeded` with exactly-once coverage, no lease or attempt left running, and
only winning attempts' parts in the manifest.

CI runs one seed per scenario; the long mode is `BATCHINF_CHAOS_SEEDS=N pytest tests/chaos`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest
from sqlalchemy import select

from batchinf.ledger.db import tx
from batchinf.ledger.tables import attempts, shards
from batchinf.store import get_store
from tests.helpers.cluster import SLOW, exactly_once, job, leased_worker_pid, start_fleet, wait
from tests.helpers.env import reset_process_state

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.slow]
SCENARIOS = ["db-restart", "broker-restart", "sigstop-past-lease", "worker-kill"]
SEEDS = range(int(os.environ.get("BATCHINF_CHAOS_SEEDS", "1")))


@pytest.fixture
def fleet(tmp_path: Path, bi_home: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    """A cluster on a private PostgreSQL and Redis, which the scenario may restart."""
    yield from start_fleet(tmp_path, s3_bucket, monkeypatch)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fleet_chaos(scenario: str, seed: int, fleet: tuple, tmp_path: Path, s3_bucket: str) -> None:
    cluster, pg, redis = fleet
    rng = random.Random(f"{scenario}:{seed}")
    job_id, good = job(tmp_path, s3_bucket, n=240, max_records=24)
    cluster.controller()
    cluster.worker("w1", **SLOW)
    cluster.worker("w2", **SLOW)
    at = rng.randint(1, 5)                                  # the seeded moment: after `at` commits
    wait(job_id, cluster, until=lambda s: s["shards"]["committed"] >= at)
    if scenario == "db-restart":
        pg.restart()
        reset_process_state()
    elif scenario == "broker-restart":
        redis.restart(down_seconds=rng.uniform(0.5, 2.0))   # every queued message is lost
    else:
        deadline = time.monotonic() + 30
        while (pid := leased_worker_pid()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid is None:
            raise AssertionError(f"no worker holds a lease\n{cluster.log_tail()}")
        if scenario == "sigstop-past-lease":
            os.kill(pid, signal.SIGSTOP)
            time.sleep(4 + rng.uniform(1.0, 3.0))           # past the 4 s lease
            os.kill(pid, signal.SIGCONT)
        else:
            os.kill(pid, signal.SIGKILL)
            cluster.worker("w3", **SLOW)
    wait(job_id, cluster, timeout=240)
    m = exactly_once(job_id, s3_bucket, good)

    time.sleep(1)                                           # a resumed zombie may try to commit now
    with tx() as conn:
        rows = {r.id: r for r in conn.execute(select(shards).where(shards.c.job_id == job_id)).all()}
        live = conn.execute(select(attempts.c.shard_id).where(attempts.c.status == "running")).all()
        winners = {(a.shard_id, a.number) for a in conn.execute(
            select(attempts).where(attempts.c.status == "committed")).all()}
    assert not [s for s in rows.values() if s.lease_owner is not None], "a lease is still held"
    assert not live, "an attempt is still marked running"
    for p in m["parts"]:
        sh = rows[p["shard"]]
        assert sh.status == "quarantined" or (sh.id, sh.attempt) in winners
        assert p["sha256"] == (sh.output_sha256 if p["kind"] == "results" else sh.errors_sha256)
    published = json.loads(get_store(s3_bucket).get_bytes(f"{s3_bucket}/out/_MANIFEST.json"))
    assert published["counts"]["records_total"] == len(good) + 6
