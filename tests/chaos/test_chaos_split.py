"""Chaos at every step of a dynamic split: a job planned as one shard runs on two workers, so the
idle one gets the running shard split, again and again; the split attempt's worker crashes before
or after its split commit (`split.before_commit`, `split.after_commit`). Embedded (a WorkerPool of
two processes; embed, and generate, whose continuous batch splits between admissions) and
distributed (a controller and two Celery workers). The job must end `succeeded` with
exactly-once coverage; a generate job's sampled answers are those of a run without crashes."""

from __future__ import annotations

import json
import os
import time
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
from tests.helpers.env import OPERATOR
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


def _crashed(job_id: str) -> bool:
    """A worker of the job died: an attempt was lost, or a third worker process (a replacement
    for a dead one) ran an attempt. Neither need show when a split commit was the crash's last
    act and the survivor ran the rest, hence up to RUNS jobs per scenario."""
    with tx() as conn:
        mine = select(shards.c.id).where(shards.c.job_id == job_id)
        rows = conn.execute(select(attempts.c.worker, attempts.c.status).where(attempts.c.shard_id.in_(mine))).all()
    return len({r.worker for r in rows}) > 2 or any(r.status == "lost" for r in rows)


def _coverage(job_id: str, records: int) -> None:
    """Splits happened; committed shards cover the records once; no lease left."""
    with tx() as conn:
        rows = conn.execute(select(shards).where(shards.c.job_id == job_id, shards.c.bucket >= 0)).all()
    assert any(r.parent_id for r in rows), "no shard was split; the scenario tested nothing"
    assert sum(r.num_records for r in rows if r.status == "committed") == records
    assert not [r.id for r in rows if r.lease_owner is not None]


RUNS = 4        # a probabilistic crash that never fired in a run tested nothing: run another job


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
    for run in range(RUNS):
        out = tmp_path / f"out{run}"
        raw = manifest(str(tmp_path / "a.jsonl"), str(out), shards={"max_records": 4096, "target_workers": 1},
                       options={"max_batch_tokens": 25})
        job_id, _ = submit(parse_manifest(raw), OPERATOR)
        assert drive(job_id, workers=2, threads=1, tick=0.2) == "succeeded"

        assert verify_output(str(out))["ok"]            # exactly-once coverage, digests, counts
        results = pq.read_table(out, ignore_prefixes=["_", "errors"]).column("record_id").to_pylist()
        assert sorted(results) == sorted(good)
        _coverage(job_id, 240)
        if _crashed(job_id):
            return
    pytest.fail(f"no worker crashed in {RUNS} jobs; the scenario tested nothing")


GENERATE_RECORDS = 96
GENERATE_SLOW = ";".join(f"execute.record[g{i}]=sleep(0.05)" for i in range(GENERATE_RECORDS))   # per attempt,
# upfront; a crash before the split commit is drawn less often than for embed: every one costs a worker
# restart and a generate shard splits between admissions, often
GENERATE_SCENARIOS = {"crash-before-split-commit": "split.before_commit=0.3*crash",
                      "crash-after-split-commit": SCENARIOS["crash-after-split-commit"]}


@pytest.fixture
def tiny_llama(bi_home: Path, tmp_path: Path) -> str:
    from batchinf.bundles import import_bundle
    from tests.helpers.tiny_llama import make_tiny_llama

    return import_bundle(make_tiny_llama(tmp_path / "tiny-llama"), "tinyllama", alias="prod").digest


def _generate(tmp_path: Path, out: Path) -> str:
    """A sampled generate job over `GENERATE_RECORDS` prompts, planned as one shard; its id."""
    inp = tmp_path / "prompts.jsonl"
    if not inp.exists():
        words = "the people of the world make water and light every day of the year".split()
        inp.write_text("".join(json.dumps({"id": f"g{i}", "prompt": " ".join(words[: 1 + i % 13]) + f" {i}"}) + "\n"
                               for i in range(GENERATE_RECORDS)))
    raw = {"name": "split-generate", "task": "generate", "bundle": "tinyllama@prod",
           "input": {"uri": str(inp), "format": "jsonl"}, "output": {"uri": str(out)},
           "shards": {"max_records": 4096, "target_workers": 1},
           "options": {"temperature": 0.9, "top_p": 0.95, "seed": 3, "max_tokens": 10, "max_slots": 4}}
    return submit(parse_manifest(raw), OPERATOR)[0]


def _answers(out: Path) -> dict[str, tuple[str, list[int]]]:
    t = pq.read_table(out, columns=["record_id", "text", "output_ids"], ignore_prefixes=["_", "errors"]).to_pylist()
    return {r["record_id"]: (r["text"], r["output_ids"]) for r in t}


@pytest.mark.parametrize("scenario", sorted(GENERATE_SCENARIOS))
def test_split_chaos_generate(scenario: str, tmp_path: Path, tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {**FINE, "BATCHINF_MAX_ATTEMPTS": "20", "BATCHINF_JOB_RETRY_BUDGET": "1000"}.items():
        monkeypatch.setenv(k, v)
    settings.cache_clear()
    clean_id = _generate(tmp_path, tmp_path / "clean")
    assert drive(clean_id, workers=1, threads=1, tick=0.2) == "succeeded"
    want = _answers(tmp_path / "clean")
    assert len(want) == GENERATE_RECORDS and len({t for t, _ in want.values()}) > GENERATE_RECORDS // 2
    monkeypatch.setenv("BATCHINF_FAILPOINTS", f"{GENERATE_SCENARIOS[scenario]};{GENERATE_SLOW}")
    settings.cache_clear()
    for run in range(RUNS):
        out = tmp_path / f"out{run}"
        job_id = _generate(tmp_path, out)
        assert drive(job_id, workers=2, threads=1, tick=0.2) == "succeeded"
        assert verify_output(str(out))["ok"]
        assert _answers(out) == want            # split (and crashed) or not, the same sampled bytes
        _coverage(job_id, GENERATE_RECORDS)
        if _crashed(job_id):
            return
    pytest.fail(f"no worker crashed in {RUNS} jobs; the scenario tested nothing")


@pytest.fixture
def cluster(tmp_path: Path, bi_home: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    for k, v in {**FINE, "BATCHINF_JOB_RETRY_BUDGET": "1000", "BATCHINF_MAX_ATTEMPTS": "20"}.items():
        monkeypatch.setenv(k, v)
    yield from start_cluster(tmp_path, s3_bucket, monkeypatch)


W1_SLOW = ";".join(f"execute.record[r{i}]=sleep(0.2)" for i in range(240))   # 48 s alone
DISTRIBUTED = {     # on the worker that holds the shard first; its peer splits cleanly
    "crash-before-split-commit": "split.before_commit=crash",
    "crash-after-split-commit": "split.after_commit=crash",
}


@pytest.mark.parametrize("scenario", sorted(DISTRIBUTED))
def test_split_chaos_distributed(scenario: str, cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    """w1 leases the job's one shard before w2 starts, so w2's idleness makes the controller ask
    w1 to split (once it counts w2: its fleet count is refreshed every FLEET_REFRESH_SECONDS, so
    w1 is slow enough to still hold most of the shard then), and w1 dies at the split failpoint
    (read from its log: Celery reports the pool process' exit). w1 would die at every split it is
    asked for, so it is then replaced by a clean worker; the job still ends with every record
    once and with a split shard."""
    job_id, good = job(tmp_path, s3_bucket, n=240, max_records=4096, target_workers=1)
    cluster.controller()
    cluster.worker("w1", BATCHINF_FAILPOINTS=f"{DISTRIBUTED[scenario]};{W1_SLOW}")
    wait(job_id, cluster, timeout=120, until=lambda s: _leased(job_id))
    cluster.worker("w2", BATCHINF_FAILPOINTS=SLOW_RECORDS)
    assert _logged(cluster.logs / "w1.log", "exitcode 137", within=180), "w1 never crashed"
    cluster.kill("w1")
    cluster.worker("w1b", BATCHINF_FAILPOINTS=SLOW_RECORDS)
    wait(job_id, cluster, timeout=300)
    exactly_once(job_id, s3_bucket, good)
    _coverage(job_id, 240)


def _logged(log: Path, text: str, within: float) -> bool:
    """Celery reports a lost pool process only after its worker_lost_wait (10 s by default)."""
    deadline = time.monotonic() + within
    while text not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _leased(job_id: str) -> bool:
    with tx() as conn:
        return conn.execute(select(shards.c.id).where(shards.c.job_id == job_id,
                                                      shards.c.lease_owner.is_not(None))).first() is not None
