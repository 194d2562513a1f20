"""Chaos at every step of a dynamic split: a job planned as one shard runs on two workers, so the
idle one gets the running shard split, again and again; the split attempt's worker crashes before
or after its split commit (`split.before_commit`, `split.after_commit`). Embedded (a LocalPool of
two processes) and distributed (a controller and two Celery workers). The job must end
`succeeded` with exactly-once coverage."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from batchinf.config import settings
from batchinf.controller import drive
from batchinf.ledger.db import tx
from batchinf.ledger.tables import attempts, shards
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from batchinf.verify import verify_output
from tests.helpers.cluster import Cluster, exactly_once, job, start_cluster, wait
from tests.helpers.corpus import manifest, write_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.slow]

SLOW_RECORDS = ";".join(f"execute.record[r{i}]=sleep(0.05)" for i in range(0, 240, 2))   # splits get time
SCENARIOS = {
    "crash-before-split-commit": "split.before_commit=0.7*crash",
    "crash-after-split-commit": "split.after_commit=crash",       # every split commit, then its worker dies
    "crash-around-split-commit": "split.before_commit=0.3*crash;split.after_commit=0.3*crash;"
                                 "execute.after_commit=0.2*crash",
}
SEEDS = range(int(os.environ.get("BATCHINF_CHAOS_SEEDS", "1")))
FINE = {"BATCHINF_SPLIT_CHUNK_TOKENS": "100", "BATCHINF_MIN_SHARD_TOKENS": "1"}   # the tiny corpus splits


def _evidence(job_id: str, records: int) -> None:
    """Splits and crashes really happened; committed shards cover the records once; no lease left."""
    with tx() as conn:
        rows = conn.execute(select(shards).where(shards.c.job_id == job_id, shards.c.bucket >= 0)).all()
        workers = set(conn.execute(select(attempts.c.worker)).scalars())
        lost = conn.execute(select(attempts.c.status).where(attempts.c.status == "lost")).all()
    assert any(r.parent_id for r in rows), "no shard was split; the scenario tested nothing"
    children = sum(1 for r in rows if r.parent_id)
    assert len(workers) > 2 or lost, f"no worker crashed; the scenario tested nothing ({children} split children)"
    assert sum(r.num_records for r in rows if r.status == "committed") == records
    assert not [r.id for r in rows if r.lease_owner is not None]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_split_chaos(scenario: str, seed: int, tmp_path: Path, tiny_bundle: str,
                     monkeypatch: pytest.MonkeyPatch) -> None:
    good = write_jsonl(tmp_path / "a.jsonl", 240, seed=seed, bad=False)
    monkeypatch.setenv("BATCHINF_FAILPOINTS", f"{SCENARIOS[scenario]};{SLOW_RECORDS}")
    monkeypatch.setenv("BATCHINF_FAILPOINTS_SEED", str(seed))
    for k, v in FINE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("BATCHINF_MAX_ATTEMPTS", "20")
    monkeypatch.setenv("BATCHINF_JOB_RETRY_BUDGET", "1000")
    settings.cache_clear()
    out = tmp_path / "out"
    raw = manifest(str(tmp_path / "a.jsonl"), str(out), shards={"max_records": 4096, "target_workers": 1},
                   options={"max_batch_tokens": 25})
    job_id, _ = submit(parse_manifest(raw))
    assert drive(job_id, workers=2, threads=1, tick=0.2) == "succeeded"

    assert verify_output(str(out))["ok"]            # exactly-once coverage, digests, counts
    results = pq.read_table(out, ignore_prefixes=["_", "errors"]).column("record_id").to_pylist()
    assert sorted(results) == sorted(good)
    _evidence(job_id, 240)


@pytest.fixture
def cluster(tmp_path: Path, bi_home: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    for k, v in {**FINE, "BATCHINF_JOB_RETRY_BUDGET": "1000", "BATCHINF_MAX_ATTEMPTS": "20"}.items():
        monkeypatch.setenv(k, v)
    yield from start_cluster(tmp_path, s3_bucket, monkeypatch)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scenario", ["crash-before-split-commit", "crash-after-split-commit"])
def test_split_chaos_distributed(scenario: str, seed: int, cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    job_id, good = job(tmp_path, s3_bucket, n=240, max_records=4096, target_workers=1)
    faults = {"BATCHINF_FAILPOINTS": f"{SCENARIOS[scenario]};{SLOW_RECORDS}", "BATCHINF_FAILPOINTS_SEED": str(seed)}
    cluster.controller()
    cluster.worker("w1", **faults)
    cluster.worker("w2", **faults)
    wait(job_id, cluster, timeout=300)
    exactly_once(job_id, s3_bucket, good)
    _evidence(job_id, 240)
