"""Distributed mode with real processes: a controller and Celery workers as subprocesses sharing one
PostgreSQL ledger, one broker and one S3 server, and the checks every distributed scenario ends with
(exactly-once coverage). Used by the `cluster` fixture (tests/integration/conftest.py) and by the
chaos fleet, which builds its own cluster on private PostgreSQL/Redis instances."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.env import reset_process_state, subprocess_env
from tests.helpers.services import PrivatePostgres, PrivateRedis, fresh_postgres_db, fresh_redis_db, unavailable

# A worker that writes each shard's output slowly (0.4 s), so that a test can act mid-job.
SLOW = {"BATCHINF_FAILPOINTS": "execute.after_write=sleep(0.4)"}


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


def cluster_env(mp: pytest.MonkeyPatch, *, database_url: str, broker_url: str, s3_bucket: str,
                queue_prefix: str = "batchinf-test", **extra: str) -> None:
    """Point this process (and the cluster's subprocesses, which inherit it) at one ledger, broker,
    queue and bundle store; short leases. Resets the process state and upgrades the ledger."""
    from batchinf.ledger.db import upgrade

    env_vars = {
        "BATCHINF_DATABASE_URL": database_url, "BATCHINF_BROKER_URL": broker_url,
        "BATCHINF_QUEUE": f"{queue_prefix}-{uuid.uuid4().hex[:8]}",
        "BATCHINF_BUNDLE_STORE": f"{s3_bucket}/bundles/", "BATCHINF_LEASE_SECONDS": "4",
        "BATCHINF_HEARTBEAT_SECONDS": "0.5", "BATCHINF_MAX_ATTEMPTS": "4",
        **extra,
    }
    for k, v in env_vars.items():
        mp.setenv(k, v)
    reset_process_state()
    upgrade(database_url)


def start_cluster(tmp_path: Path, s3_bucket: str, mp: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """The `cluster` fixture's body: a fresh PostgreSQL database and Redis database on the shared
    servers (missing ones skip, or fail under BATCHINF_REQUIRE_SERVICES=1); no process started yet."""
    broker = fresh_redis_db()
    cluster_env(mp, database_url=fresh_postgres_db(), broker_url=broker, s3_bucket=s3_bucket)
    logs = tmp_path / "logs"
    logs.mkdir()
    c = Cluster(subprocess_env(), logs)
    yield c
    c.stop_all()


def start_fleet(tmp_path: Path, s3_bucket: str, mp: pytest.MonkeyPatch) -> Iterator[tuple]:
    """The chaos `fleet` fixture's body: a cluster on a private PostgreSQL and Redis (which the
    scenario may restart); yields (cluster, postgres, redis)."""
    try:
        pg = PrivatePostgres().start()
        redis = PrivateRedis().start()
    except RuntimeError as exc:
        unavailable(f"cannot start a private PostgreSQL/Redis for chaos: {exc}")
    cluster_env(mp, database_url=pg.url, broker_url=redis.url, s3_bucket=s3_bucket, queue_prefix="batchinf-chaos",
                BATCHINF_MAX_ATTEMPTS="6", BATCHINF_JOB_RETRY_BUDGET="100")
    logs = tmp_path / "logs"
    logs.mkdir()
    cluster = Cluster(subprocess_env(), logs)
    try:
        yield cluster, pg, redis
    finally:
        cluster.stop_all()
        reset_process_state()
        redis.stop()
        pg.stop()


def job(tmp_path: Path, bucket: str, n: int = 600, max_records: int = 50,
        **shards_extra: int) -> tuple[str, dict[str, str]]:
    """Import the tiny BERT as `tiny@prod`, upload n good records (and the bad ones) to the bucket,
    submit an embed job over them; returns (job id, id -> text of the good records)."""
    import boto3

    from batchinf.bundles import import_bundle
    from tests.helpers.env import OPERATOR
    from batchinf.submit import submit
    from batchinf.manifest import parse_manifest
    from tests.helpers.tiny_models import make_tiny_bert

    import_bundle(make_tiny_bert(tmp_path / "tiny"), "tiny", alias="prod")
    good = write_jsonl(tmp_path / "in.jsonl", n, seed=21)
    s3 = boto3.client("s3", endpoint_url=os.environ["BATCHINF_S3_ENDPOINT_URL"])
    s3.upload_file(str(tmp_path / "in.jsonl"), bucket.removeprefix("s3://"), "in/part-0.jsonl")
    job_id, _ = submit(parse_manifest(manifest(f"{bucket}/in/", f"{bucket}/out/",
                                               shards={"max_records": max_records, **shards_extra})), OPERATOR)
    return job_id, good


def wait(job_id: str, cluster: Cluster, timeout: float = 180,
         until: Callable[[dict], bool] | None = None) -> dict:
    """Poll the job's status until `until` (default: a terminal state); AssertionError with the logs if not."""
    from batchinf.ledger.status import status
    from batchinf.ledger.states import JOB_TERMINAL

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = status(job_id)
        if (until or (lambda s: s["status"] in JOB_TERMINAL))(s):
            return s
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} stuck at {status(job_id)}\n{cluster.log_tail()}")


def exactly_once(job_id: str, bucket: str, good: dict[str, str]) -> dict:
    """The job succeeded, every good record has exactly one result and the 6 bad ones failed;
    returns the published _MANIFEST.json."""
    from batchinf.ledger.status import status
    from batchinf.parts import read_table
    from batchinf.store import get_store
    from batchinf.verify import verify_output

    s = status(job_id)
    assert s["status"] == "succeeded", s
    report = verify_output(f"{bucket}/out/")
    m = json.loads(get_store(bucket).get_bytes(f"{bucket}/out/_MANIFEST.json"))
    ids: list[str] = []
    for p in m["parts"]:
        if p["kind"] == "results":
            ids += read_table(f"{bucket}/out/{p['key']}").column("record_id").to_pylist()
    assert sorted(ids) == sorted(good)
    assert report["counts"]["records_failed"] == 6
    return m


def leased_worker_pid() -> int | None:
    """The pid of a worker process holding a shard lease right now, if any."""
    from batchinf.ledger.db import tx
    from batchinf.ledger.tables import shards

    with tx() as conn:
        owner = conn.execute(select(shards.c.lease_owner).where(shards.c.status == "running")).scalars().first()
    return int(owner.rsplit(":", 1)[1]) if owner else None
