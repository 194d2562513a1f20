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
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from sqlalchemy import select

from batchinf.ledger.db import tx, upgrade
from batchinf.ledger.tables import attempts, shards
from batchinf.store import get_store
from tests.conftest import _reset_process_state, _unavailable
from tests.helpers.services import PrivatePostgres, PrivateRedis
from tests.integration.test_distributed import SLOW, Cluster, _exactly_once, _job, _leased_worker_pid, _wait

pytestmark = pytest.mark.integration
SCENARIOS = ["db-restart", "broker-restart", "sigstop-past-lease", "worker-kill"]
SEEDS = range(int(os.environ.get("BATCHINF_CHAOS_SEEDS", "1")))


@pytest.fixture
def fleet(tmp_path: Path, bi_home: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    try:
        pg = PrivatePostgres().start()
        redis = PrivateRedis().start()
    except RuntimeError as exc:
        _unavailable(f"cannot start a private PostgreSQL/Redis for chaos: {exc}")
    env_vars = {
        "BATCHINF_DATABASE_URL": pg.url, "BATCHINF_BROKER_URL": redis.url,
        "BATCHINF_QUEUE": f"batchinf-chaos-{uuid.uuid4().hex[:8]}",
        "BATCHINF_BUNDLE_STORE": f"{s3_bucket}/bundles/", "BATCHINF_LEASE_SECONDS": "4",
        "BATCHINF_HEARTBEAT_SECONDS": "0.5", "BATCHINF_MAX_ATTEMPTS": "6",
        "BATCHINF_JOB_RETRY_BUDGET": "100",
    }
    for k, v in env_vars.items():
        monkeypatch.setenv(k, v)
    _reset_process_state()
    upgrade(pg.url)
    logs = tmp_path / "logs"
    logs.mkdir()
    cluster = Cluster(dict(os.environ), logs)
    try:
        yield cluster, pg, redis
    finally:
        cluster.stop_all()
        _reset_process_state()
        redis.stop()
        pg.stop()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fleet_chaos(scenario: str, seed: int, fleet: tuple, tmp_path: Path, s3_bucket: str) -> None:
    cluster, pg, redis = fleet
    rng = random.Random(f"{scenario}:{seed}")
    job_id, good = _job(tmp_path, s3_bucket, n=240, max_records=24)
    cluster.controller()
    cluster.worker("w1", **SLOW)
    cluster.worker("w2", **SLOW)
    at = rng.randint(1, 5)                                  # the seeded moment: after `at` commits
    _wait(job_id, cluster, until=lambda s: s["shards"]["committed"] >= at)
    if scenario == "db-restart":
        pg.restart()
        _reset_process_state()
    elif scenario == "broker-restart":
        redis.restart(down_seconds=rng.uniform(0.5, 2.0))   # every queued message is lost
    else:
        deadline = time.monotonic() + 30
        while (pid := _leased_worker_pid()) is None and time.monotonic() < deadline:
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
    _wait(job_id, cluster, timeout=240)
    m = _exactly_once(job_id, s3_bucket, good)

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
