"""Distributed mode with real processes: PostgreSQL ledger, Redis broker, S3 server, a controller
and Celery workers as subprocesses. Each scenario ends with exactly-once coverage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from batchinf.ledger.status import status
from batchinf.submit import submit
from batchinf.ledger.db import tx
from batchinf.ledger.states import JOB_TERMINAL
from batchinf.ledger.tables import attempts, shards
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from batchinf.verify import verify_output
from tests.conftest import _fresh_postgres_db, _reset_process_state, _unavailable
from tests.helpers.corpus import manifest, write_jsonl

pytestmark = pytest.mark.integration
REDIS = os.environ.get("BATCHINF_TEST_REDIS", "redis://127.0.0.1:6379")


class Cluster:
    """A controller and workers as real processes sharing one ledger, broker and S3 server."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "batchinf.cli", *args], env={**self.env, **(extra_env or {})},
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = p
        return p

    def controller(self, name: str = "controller") -> subprocess.Popen:
        return self.start(name, "controller", "--tick", "0.2", "--requeue-seconds", "3", "--max-in-flight", "4")

    def worker(self, name: str, **extra_env: str) -> subprocess.Popen:
        return self.start(name, "worker", "--concurrency", "1", "--threads", "1", "--device", "cpu",
                          "--hostname", f"{name}@%h", extra_env=extra_env)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs.pop(name)
        os.killpg(p.pid, sig)
        p.wait(timeout=30)

    def stop_all(self) -> None:
        for name in list(self.procs):
            try:
                self.kill(name, signal.SIGKILL)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    def log_tail(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in self.logs.glob("*.log"))


@pytest.fixture
def cluster(tmp_path: Path, bi_home: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    try:
        import redis
        db = 1 + uuid.uuid4().int % 15
        broker = f"{REDIS}/{db}"
        redis.Redis.from_url(broker, socket_connect_timeout=3).flushdb()
    except Exception as exc:  # noqa: BLE001
        _unavailable(f"Redis is not reachable at {REDIS}: {exc}")
    url = _fresh_postgres_db()
    env_vars = {
        "BATCHINF_DATABASE_URL": url, "BATCHINF_BROKER_URL": broker,
        "BATCHINF_QUEUE": f"batchinf-test-{uuid.uuid4().hex[:8]}",
        "BATCHINF_BUNDLE_STORE": f"{s3_bucket}/bundles/", "BATCHINF_LEASE_SECONDS": "4",
        "BATCHINF_HEARTBEAT_SECONDS": "0.5", "BATCHINF_MAX_ATTEMPTS": "4",
    }
    for k, v in env_vars.items():
        monkeypatch.setenv(k, v)
    _reset_process_state()
    from batchinf.ledger.db import upgrade
    upgrade(url)
    logs = tmp_path / "logs"
    logs.mkdir()
    c = Cluster(dict(os.environ), logs)
    yield c
    c.stop_all()


def _job(tmp_path: Path, bucket: str, n: int = 600, max_records: int = 50) -> tuple[str, dict[str, str]]:
    import boto3

    from batchinf.bundles import import_bundle
    from tests.helpers.tiny_models import make_tiny_bert

    import_bundle(make_tiny_bert(tmp_path / "tiny"), "tiny", alias="prod")
    good = write_jsonl(tmp_path / "in.jsonl", n, seed=21)
    s3 = boto3.client("s3", endpoint_url=os.environ["BATCHINF_S3_ENDPOINT_URL"])
    s3.upload_file(str(tmp_path / "in.jsonl"), bucket.removeprefix("s3://"), "in/part-0.jsonl")
    job_id, _ = submit(parse_manifest(manifest(f"{bucket}/in/", f"{bucket}/out/",
                                               shards={"max_records": max_records})))
    return job_id, good


def _wait(job_id: str, cluster: Cluster, timeout: float = 180, until=None) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = status(job_id)
        if (until or (lambda s: s["status"] in JOB_TERMINAL))(s):
            return s
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} stuck at {status(job_id)}\n{cluster.log_tail()}")


def _exactly_once(job_id: str, bucket: str, good: dict[str, str]) -> dict:
    s = status(job_id)
    assert s["status"] == "succeeded", s
    report = verify_output(f"{bucket}/out/")
    m = json.loads(__import__("batchinf.store", fromlist=["get_store"]).get_store(bucket)
                   .get_bytes(f"{bucket}/out/_MANIFEST.json"))
    ids: list[str] = []
    for p in m["parts"]:
        if p["kind"] == "results":
            ids += read_table(f"{bucket}/out/{p['key']}").column("record_id").to_pylist()
    assert sorted(ids) == sorted(good)
    assert report["counts"]["records_failed"] == 6
    return m


def _leased_worker_pid() -> int | None:
    with tx() as conn:
        owner = conn.execute(select(shards.c.lease_owner).where(shards.c.status == "running")).scalars().first()
    return int(owner.rsplit(":", 1)[1]) if owner else None


SLOW = {"BATCHINF_FAILPOINTS": "execute.after_write=sleep(0.4)"}


def test_two_workers_complete_a_job_identical_to_embedded(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    job_id, good = _job(tmp_path, s3_bucket)
    cluster.controller()
    cluster.worker("w1")
    cluster.worker("w2")
    _wait(job_id, cluster)
    m = _exactly_once(job_id, s3_bucket, good)
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
    import socket

    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=3).close()
    except OSError as exc:
        _unavailable(f"RabbitMQ is not reachable on 127.0.0.1:5672: {exc}")
    cluster.env["BATCHINF_BROKER_URL"] = "amqp://guest:guest@127.0.0.1:5672//"
    job_id, good = _job(tmp_path, s3_bucket, n=200)
    cluster.controller()
    cluster.worker("w1")
    _wait(job_id, cluster)
    _exactly_once(job_id, s3_bucket, good)


def test_worker_killed_mid_shard(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    job_id, good = _job(tmp_path, s3_bucket)
    cluster.controller()
    cluster.worker("w1", **SLOW)
    cluster.worker("w2", **SLOW)
    _wait(job_id, cluster, until=lambda s: s["shards"]["committed"] >= 2)
    deadline = time.monotonic() + 30
    while (pid := _leased_worker_pid()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)                      # the Celery child running a shard
    _wait(job_id, cluster)
    _exactly_once(job_id, s3_bucket, good)
    with tx() as conn:
        lost = conn.execute(select(attempts.c.status).where(attempts.c.status.in_(["lost", "swept"]))).scalars().all()
    assert lost, "the killed attempt should have been detected through its lease"


def test_controller_killed_and_restarted(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    job_id, good = _job(tmp_path, s3_bucket)
    cluster.controller("c1")
    cluster.worker("w1", **SLOW)
    _wait(job_id, cluster, until=lambda s: s["shards"]["committed"] >= 2)
    cluster.kill("c1")
    time.sleep(1)
    cluster.controller("c2")
    cluster.controller("c3")                         # two controllers at once are safe
    _wait(job_id, cluster)
    _exactly_once(job_id, s3_bucket, good)


def test_broker_flushed_mid_job(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    import redis

    job_id, good = _job(tmp_path, s3_bucket)
    cluster.controller()
    cluster.worker("w1", **SLOW)
    _wait(job_id, cluster, until=lambda s: s["shards"]["committed"] >= 1)
    redis.Redis.from_url(os.environ["BATCHINF_BROKER_URL"]).flushdb()   # every queued message lost
    _wait(job_id, cluster)
    _exactly_once(job_id, s3_bucket, good)


def test_paused_worker_cannot_commit_late(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    """A worker SIGSTOPped past its lease, resumed after another attempt committed: its late
    commit changes nothing and its files never appear in the manifest."""
    job_id, good = _job(tmp_path, s3_bucket, n=200)
    cluster.controller()
    cluster.worker("w1", BATCHINF_FAILPOINTS="execute.before_commit=sleep(1.5)")
    deadline = time.monotonic() + 60
    while (pid := _leased_worker_pid()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pid is not None
    with tx() as conn:
        paused_shard = conn.execute(select(shards.c.id).where(shards.c.status == "running")).scalars().first()
    os.kill(pid, signal.SIGSTOP)
    cluster.worker("w2")
    _wait(job_id, cluster, until=lambda s: s["status"] in JOB_TERMINAL or s["shards"]["committed"] == s["shards"]["total"])
    os.kill(pid, signal.SIGCONT)
    _wait(job_id, cluster)
    m = _exactly_once(job_id, s3_bucket, good)
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

    job_id, _ = _job(tmp_path, s3_bucket)
    cluster.controller()
    cluster.worker("w1", **SLOW)
    _wait(job_id, cluster, until=lambda s: s["shards"]["committed"] >= 2)
    cancel(job_id)
    s = _wait(job_id, cluster)
    assert s["status"] == "cancelled"
    store = get_store(s3_bucket)
    assert not store.exists(f"{s3_bucket}/out/_SUCCESS") and not store.exists(f"{s3_bucket}/out/_MANIFEST.json")
    partial = json.loads(store.get_bytes(f"{s3_bucket}/out/_PARTIAL.json"))
    c = partial["counts"]
    assert c["records_done"] + c["records_not_done"] == c["records_total"] and c["records_not_done"] > 0
    with tx() as conn:
        assert not conn.execute(select(shards.c.id).where(shards.c.job_id == job_id,
                                                          shards.c.status == "running")).all()
