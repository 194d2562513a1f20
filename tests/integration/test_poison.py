"""Poison records: one that raises is isolated by splitting its batch; one that kills its worker
is isolated by splitting its shard until it is alone, then quarantined. The job completes."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from batchinf.config import settings
from batchinf.controller import drive
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.ledger.db import tx
from batchinf.ledger.status import status
from batchinf.ledger.tables import attempts, jobs
from batchinf.manifest import parse_manifest
from batchinf.verify import verify_output
from tests.helpers.corpus import manifest, write_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run(tmp_path: Path, failpoints: str, monkeypatch: pytest.MonkeyPatch, n: int = 64,
         lanes: int = 1) -> tuple[list, list, str]:
    good = write_jsonl(tmp_path / "a.jsonl", n, bad=False, seed=9)
    monkeypatch.setenv("BATCHINF_FAILPOINTS", failpoints)    # read by the worker processes
    monkeypatch.setenv("BATCHINF_MAX_ATTEMPTS", "1")
    settings.cache_clear()
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(out), shards={"max_records": 32})), OPERATOR)
    assert drive(job_id, workers=1, threads=1, lanes=lanes) == "succeeded"
    assert verify_output(str(out))["ok"]
    results = pq.read_table(out, ignore_prefixes=["_", "errors"]).to_pylist()
    errors = pq.read_table(out / "errors").to_pylist()
    assert len(results) + len(errors) == len(good)
    return results, errors, job_id


def test_record_that_raises_becomes_an_error_row(tmp_path: Path, tiny_bundle: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    results, errors, _ = _run(tmp_path, "execute.record[r5]=raise", monkeypatch)
    assert [(e["record_id"], e["error"]) for e in errors] == [("r5", "inference_error")]
    assert "failpoint execute.record[r5] raised" in errors[0]["message"]
    assert len(results) == 63


def test_record_that_kills_its_worker_is_quarantined(tmp_path: Path, tiny_bundle: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    results, errors, job_id = _run(tmp_path, "execute.record[r37]=crash", monkeypatch)
    assert [(e["record_id"], e["error"]) for e in errors] == [("r37", "poison")]
    assert "killed the worker" in errors[0]["message"]
    counts = status(job_id)["counts"]      # the status counts the poison row as the manifest does
    assert (counts["records_done"], counts["records_succeeded"], counts["records_failed"]) == (64, 63, 1)
    assert sorted(r["record_id"] for r in results) == sorted(f"r{i}" for i in range(64) if i != 37)


def test_a_record_that_kills_a_worker_of_lanes_loses_the_other_lane_nothing(
        tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two lanes in one worker process: the poison record kills the process and the shard the other
    lane was computing with it. That shard is retried (quarantined in halves at worst) and every
    record but the poison one still gets exactly one result."""
    results, errors, job_id = _run(tmp_path, "execute.record[r37]=crash", monkeypatch, lanes=2)
    assert [(e["record_id"], e["error"]) for e in errors] == [("r37", "poison")]
    assert sorted(r["record_id"] for r in results) == sorted(f"r{i}" for i in range(64) if i != 37)
    with tx() as conn:
        workers = {w for (w,) in conn.execute(select(attempts.c.worker).where(attempts.c.status == "lost"))}
    assert workers, "the poison record's process was lost"


def _storage_fault_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, faults: str, budget: int) -> tuple[str, Path]:
    """200 good records in 10 shards, run with storage `faults` in the worker processes only
    (they read BATCHINF_FAILPOINTS at start; this process plans and publishes cleanly)."""
    write_jsonl(tmp_path / "a.jsonl", 200, bad=False, seed=4)
    monkeypatch.setenv("BATCHINF_FAILPOINTS", faults)
    monkeypatch.setenv("BATCHINF_MAX_ATTEMPTS", "20")
    monkeypatch.setenv("BATCHINF_JOB_RETRY_BUDGET", str(budget))
    settings.cache_clear()
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(out), shards={"max_records": 20})), OPERATOR)
    return drive(job_id, workers=1, threads=1), out


def test_storage_faults_are_retried(tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three in ten of the workers' storage writes fail (as a 5xx would): attempts retry with backoff
    and the job still completes with exactly-once coverage."""
    final, out = _storage_fault_job(tmp_path, monkeypatch, "store.put=0.3*raise", budget=1000)
    assert final == "succeeded"
    assert verify_output(str(out))["ok"]
    assert pq.read_table(out, ignore_prefixes=["_", "errors"]).num_rows == 200
    with tx() as conn:
        assert conn.execute(select(attempts.c.status).where(attempts.c.status == "failed")).first(), \
            "no storage fault was injected"


def test_storage_outage_fails_the_job_within_its_retry_budget(tmp_path: Path, tiny_bundle: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every storage write fails: shards may retry, but the job fails once its retry budget is
    spent, with a reason that names the budget and the last fault, and publishes nothing."""
    final, out = _storage_fault_job(tmp_path, monkeypatch, "store.put=raise", budget=4)
    assert final == "failed"
    with tx() as conn:
        error = conn.execute(select(jobs.c.error)).scalar()
        failed = conn.execute(select(attempts.c.status).where(attempts.c.status == "failed")).all()
    assert "retry budget is spent (4 failed attempts" in error and "store.put" in error
    assert len(failed) == 5
    assert not (out / "_SUCCESS").exists() and not (out / "_MANIFEST.json").exists()
