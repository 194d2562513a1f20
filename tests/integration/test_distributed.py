"""Distributed mode with real processes: PostgreSQL ledger, Redis broker, S3 server, a controller
and Celery workers as subprocesses. Each scenario ends with exactly-once coverage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from batchinf.ledger.db import tx
from batchinf.ledger.states import JOB_TERMINAL
from batchinf.ledger.tables import attempts, shards
from batchinf.parts import read_table
from batchinf.verify import verify_output
from tests.helpers.cluster import SLOW, Cluster, exactly_once, job, leased_worker_pid, wait
from tests.helpers.corpus import manifest
from tests.helpers.services import require_rabbitmq

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_two_workers_complete_a_job_identical_to_embedded(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    job_id, good = job(tmp_path, s3_bucket)
    cluster.controller()
    cluster.worker("w1")
    cluster.worker("w2")
    wait(job_id, cluster)
    m = exactly_once(job_id, s3_bucket, good)
    with tx() as conn:
        owners = set(conn.execute(select(attempts.c.worker)).scalars().all())
    assert len(owners) >= 2, "both workers should have run shards"

    # the same corpus in embedded mode (its own SQLite ledger, local files) gives identical vectors
    env = {k: v for k, v in os.environ.items() if k not in ("BATCHINF_DATABASE_URL", "BATCHINF_BUNDLE_STORE")}
    env["BATCHINF_HOME"] = str(tmp_path / "embedded-home")
    subprocess.run([sys.executable, "-m", "batchinf.cli", "bundle", "import", str(tmp_path / "tiny"),
                    "--name", "tiny", "--alias", "prod"], env=env, check=True, capture_output=True)
    (tmp_path / "job.json").write_text(json.dumps(manifest(str(tmp_path / "in.jsonl"), str(tmp_path / "emb-out"),
                                                           shards={"max_records": 50})))
    r = subprocess.run([sys.executable, "-m", "batchinf.cli", "run", str(tmp_path / "job.json"), "--json"],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    local = pq.read_table(tmp_path / "emb-out", ignore_prefixes=["_", "errors"]).to_pylist()
    dist = []
    for p in m["parts"]:
        if p["kind"] == "results":
            dist += read_table(f"{s3_bucket}/out/{p['key']}").to_pylist()
    a = {r["record_id"]: r["embedding"] for r in local}
    b = {r["record_id"]: r["embedding"] for r in dist}
    assert a.keys() == b.keys()
    diff = max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)
    assert diff <= 1e-6


def test_rabbitmq_broker_works_too(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    cluster.env["BATCHINF_BROKER_URL"] = require_rabbitmq()
    job_id, good = job(tmp_path, s3_bucket, n=200)
    cluster.controller()
    cluster.worker("w1")
    wait(job_id, cluster)
    exactly_once(job_id, s3_bucket, good)


def test_worker_killed_mid_shard(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    job_id, good = job(tmp_path, s3_bucket)
    cluster.controller()
    cluster.worker("w1", **SLOW)
    cluster.worker("w2", **SLOW)
    wait(job_id, cluster, until=lambda s: s["shards"]["committed"] >= 2)
    deadline = time.monotonic() + 30
    while (pid := leased_worker_pid()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)                      # the Celery child running a shard
    wait(job_id, cluster)
    exactly_once(job_id, s3_bucket, good)
    with tx() as conn:
        lost = conn.execute(select(attempts.c.status).where(attempts.c.status.in_(["lost", "swept"]))).scalars().all()
    assert lost, "the killed attempt should have been detected through its lease"


def test_controller_killed_and_restarted(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    job_id, good = job(tmp_path, s3_bucket)
    cluster.controller("c1")
    cluster.worker("w1", **SLOW)
    wait(job_id, cluster, until=lambda s: s["shards"]["committed"] >= 2)
    cluster.kill("c1")
    time.sleep(1)
    cluster.controller("c2")
    cluster.controller("c3")                         # two controllers at once are safe
    wait(job_id, cluster)
    exactly_once(job_id, s3_bucket, good)


def test_broker_flushed_mid_job(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    import redis

    job_id, good = job(tmp_path, s3_bucket)
    cluster.controller()
    cluster.worker("w1", **SLOW)
    wait(job_id, cluster, until=lambda s: s["shards"]["committed"] >= 1)
    redis.Redis.from_url(os.environ["BATCHINF_BROKER_URL"]).flushdb()   # every queued message lost
    wait(job_id, cluster)
    exactly_once(job_id, s3_bucket, good)


def test_paused_worker_cannot_commit_late(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    """A worker SIGSTOPped past its lease, resumed after another attempt committed: its late
    commit changes nothing and its files never appear in the manifest."""
    job_id, good = job(tmp_path, s3_bucket, n=200)
    cluster.controller()
    cluster.worker("w1", BATCHINF_FAILPOINTS="execute.before_commit=sleep(1.5)")
    deadline = time.monotonic() + 60
    while (pid := leased_worker_pid()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pid is not None
    with tx() as conn:
        paused_shard = conn.execute(select(shards.c.id).where(shards.c.status == "running")).scalars().first()
    os.kill(pid, signal.SIGSTOP)
    cluster.worker("w2")
    wait(job_id, cluster, until=lambda s: s["status"] in JOB_TERMINAL or s["shards"]["committed"] == s["shards"]["total"])
    os.kill(pid, signal.SIGCONT)
    wait(job_id, cluster)
    m = exactly_once(job_id, s3_bucket, good)
    with tx() as conn:
        rows = conn.execute(select(attempts.c.number, attempts.c.status, attempts.c.worker)
                            .where(attempts.c.shard_id == paused_shard)).all()
    assert [r.status for r in rows if r.number == 1][0] in ("lost", "swept")
    winner = [p for p in m["parts"] if p["shard"] == paused_shard]
    assert winner and all(r.number > 1 for r in rows if r.status == "committed")
    time.sleep(2)   # the resumed zombie tries to commit, fails on its fencing token
    with tx() as conn:
        assert conn.execute(select(shards.c.attempt).where(shards.c.id == paused_shard)).scalar() > 1
    assert verify_output(f"{s3_bucket}/out/")["ok"]


def test_cancel_mid_job(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    from batchinf.controller import cancel
    from batchinf.store import get_store

    job_id, _ = job(tmp_path, s3_bucket)
    cluster.controller()
    cluster.worker("w1", **SLOW)
    wait(job_id, cluster, until=lambda s: s["shards"]["committed"] >= 2)
    cancel(job_id)
    s = wait(job_id, cluster)
    assert s["status"] == "cancelled"
    store = get_store(s3_bucket)
    assert not store.exists(f"{s3_bucket}/out/_SUCCESS") and not store.exists(f"{s3_bucket}/out/_MANIFEST.json")
    partial = json.loads(store.get_bytes(f"{s3_bucket}/out/_PARTIAL.json"))
    c = partial["counts"]
    assert c["records_done"] + c["records_not_done"] == c["records_total"] and c["records_not_done"] > 0
    with tx() as conn:
        assert not conn.execute(select(shards.c.id).where(shards.c.job_id == job_id,
                                                          shards.c.status == "running")).all()
