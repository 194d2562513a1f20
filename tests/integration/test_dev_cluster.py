"""`batchinf dev cluster`: a distributed cluster on loopback in one command, a job through it with
the environment it prints, and `batchinf dev down` leaving nothing running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import yaml
from sqlalchemy import create_engine, text

from tests.helpers.services import fresh_redis_db, unavailable

pytestmark = pytest.mark.integration

SERVER = "postgresql://postgres@127.0.0.1:5432/"


def _cli(home: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHINF_", "AWS_"))}
    r = subprocess.run([sys.executable, "-m", "batchinf.cli", *args, "--json"], capture_output=True, text=True,
                       env={**base, **(env or {}), "BATCHINF_HOME": str(home)}, timeout=timeout, check=False)
    assert r.returncode == 0, r.stderr + r.stdout
    return json.loads(r.stdout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_job_runs_on_the_dev_cluster_and_down_stops_it_all(tmp_path: Path) -> None:
    from tests.helpers.tiny_models import make_tiny_bert

    if not Path("/usr/lib/postgresql").exists() and subprocess.run(["which", "initdb"]).returncode:
        unavailable("PostgreSQL's initdb is not installed")
    home = tmp_path / "home"
    env = _cli(home, "dev", "cluster", "--workers", "2")
    state = json.loads((home / "dev-cluster" / "cluster.json").read_text())
    try:
        assert set(state["pids"]) == {"redis", "s3", "controller", "worker1", "worker2"}
        assert env["BATCHINF_DATABASE_URL"].startswith("postgresql://postgres@127.0.0.1:")
        assert env["BATCHINF_BUNDLE_STORE"] == "s3://batchinf/bundles/"
        s3 = boto3.client("s3", endpoint_url=env["BATCHINF_S3_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])
        assert s3.get_bucket_versioning(Bucket="batchinf")["Status"] == "Enabled"
        again = _cli(home, "dev", "cluster")                       # already up: the same cluster
        assert again == env
        # the user's three steps: import a bundle, put the input in the bucket, submit and wait
        _cli(home, "bundle", "import", str(make_tiny_bert(tmp_path / "tiny")), "--name", "tiny", "--alias", "prod",
             env=env)
        s3.put_object(Bucket="batchinf", Key="data/in/a.jsonl", Body="".join(
            json.dumps({"id": f"r{i}", "text": f"record {i} of the dev cluster"}) + "\n" for i in range(300)).encode())
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump({"name": "dev", "task": "embed", "bundle": "tiny@prod",
                                       "input": {"uri": "s3://batchinf/data/in/", "format": "jsonl"},
                                       "output": {"uri": "s3://batchinf/data/out/"}, "shards": {"max_records": 50}}))
        st = _cli(home, "submit", str(job), "--wait", env=env)
        assert st["status"] == "succeeded" and st["counts"]["records_succeeded"] == 300, st
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="batchinf", Prefix="data/out/")["Contents"]]
        assert "data/out/_SUCCESS" in keys
    finally:
        gone = _cli(home, "dev", "down")
    assert set(gone["stopped"]) == {"redis", "s3", "controller", "worker1", "worker2", "postgres"}
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in state["pids"].values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in state["pids"].values())
    assert not (home / "dev-cluster").exists()
    assert _cli(home, "dev", "down") == {"stopped": [], "message": "no dev cluster is up"}


def test_on_existing_servers_it_makes_its_own_database_and_queue_and_drops_them(tmp_path: Path) -> None:
    home = tmp_path / "home"
    broker = fresh_redis_db()
    env = _cli(home, "dev", "cluster", "--workers", "1", "--database-url", SERVER, "--broker-url", broker)
    database = env["BATCHINF_DATABASE_URL"].rsplit("/", 1)[-1]
    try:
        assert env["BATCHINF_BROKER_URL"] == broker and env["BATCHINF_QUEUE"].startswith("batchinf-dev-")
        assert database.startswith("batchinf_dev_")
        assert _cli(home, "db", "current", env=env)["up_to_date"]          # migrated
    finally:
        _cli(home, "dev", "down")
    engine = create_engine(SERVER.replace("postgresql://", "postgresql+psycopg://") + "postgres")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": database}).first() is None
    engine.dispose()
