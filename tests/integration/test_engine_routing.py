"""Routing by engine and device in distributed mode (a controller and a Celery worker as real
processes, one PostgreSQL ledger, a Redis broker): a job on an engine no worker has, or needing cuda
when every worker is on cpu, never lands on a native cpu worker; its shard messages wait on its own
queue (engine, device), its shards stay queued and its status says what for, while a native job
beside it completes; the fleet its shards are sized for counts only workers that can run it. A
worker refuses to start for an engine it lacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from batchinf.bundles import import_bundle
from batchinf.ledger import status
from batchinf.ledger.db import tx
from batchinf.ledger.tables import attempts, shards
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from tests.helpers.cluster import Cluster, wait
from tests.helpers.env import OPERATOR
from tests.helpers.tiny_llama import make_tiny_llama

pytestmark = pytest.mark.integration


def _job(tmp_path: Path, name: str, engine: str | None, device: str | None = None) -> str:
    inp = tmp_path / f"{name}.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"the world {i}"}) + "\n" for i in range(6)))
    raw = {"name": name, "task": "generate", "bundle": "tinyllama@prod", "input": {"uri": str(inp)},
           "output": {"uri": str(tmp_path / "out" / name)}, "shards": {"max_records": 3},
           "options": {"max_tokens": 3}}
    if engine:
        raw["engine"] = engine
    if device:
        raw["options"]["device"] = device
    return submit(parse_manifest(raw), OPERATOR)[0]


def test_vllm_and_cuda_jobs_never_land_on_a_native_cpu_worker(cluster: Cluster, tmp_path: Path) -> None:
    import redis

    import_bundle(make_tiny_llama(tmp_path / "tiny-llama"), "tinyllama", alias="prod")
    vllm_job, native_job = _job(tmp_path, "on-vllm", "vllm"), _job(tmp_path, "on-native", None)
    cuda_job = _job(tmp_path, "on-cuda", None, device="cuda")
    # this environment has no vllm: a worker for it refuses to start, naming what is missing
    r = subprocess.run([sys.executable, "-m", "batchinf.cli", "worker", "--engine", "vllm"], env=cluster.env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "engine vllm needs the vllm package" in r.stdout + r.stderr
    cluster.controller()
    cluster.worker("w1")                          # native only (the default)
    assert wait(native_job, cluster)["status"] == "succeeded"
    s = wait(vllm_job, cluster, until=lambda s: s["shards"]["pending"] == 2)
    time.sleep(2)                                 # a native worker had time to take one, if it could
    s = status.status(vllm_job)
    assert s["status"] == "running" and s["engine"] == "vllm" and s["shards"]["running"] == 0
    assert "engine vllm" in s["waiting"]
    s = wait(cuda_job, cluster, until=lambda s: s["shards"]["pending"] == 2)
    assert s["status"] == "running" and s["device"] == "cuda" and s["shards"]["running"] == 0
    assert "engine native on device cuda" in s["waiting"] and "--device cuda" in s["waiting"]
    with tx() as conn:
        tried = conn.execute(select(func.count()).select_from(attempts).join(shards, shards.c.id == attempts.c.shard_id)
                             .where(shards.c.job_id.in_([vllm_job, cuda_job]))).scalar()
    assert tried == 0
    # their shard messages wait on their own queues, which only vllm (cuda) workers read
    queue = os.environ["BATCHINF_QUEUE"]
    broker = redis.Redis.from_url(os.environ["BATCHINF_BROKER_URL"])
    assert broker.llen(f"{queue}-vllm") >= 2 and broker.llen(f"{queue}-cuda") >= 2
    # the fleet a job's shards are sized for: the cpu worker counts for the native job only (asked in
    # a process of its own: the Celery app keeps the first broker it was configured with)
    ask = ("import json, sys; from batchinf.ledger import jobs; from batchinf.workers.celery_app import "
           "CeleryDispatcher; d = CeleryDispatcher(); "
           "print(json.dumps([d.workers(None)] + [d.workers(jobs.get(j).route) for j in sys.argv[1:]]))")
    r = subprocess.run([sys.executable, "-c", ask, native_job, vllm_job, cuda_job], env=cluster.env,
                       capture_output=True, text=True, timeout=120)
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [1, 1, None, None], r.stderr[-2000:]
