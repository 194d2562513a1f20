"""The lifecycle stages one at a time, in this process, on an embedded SQLite ledger and a tiny
generated bundle: plan, execute, verify, and the lifecycle step that both drivers share (with an
in-process dispatcher), including per-job failure isolation."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchinf.controller import Controller, cancel
from batchinf.errors import VerificationError
from batchinf.execute import execute_shard
from batchinf.ledger import jobs, leases, shards
from batchinf.ledger.models import Job
from batchinf.ledger.states import SHARD_DONE, JobStatus, ShardStatus
from batchinf.lifecycle import step
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.verify import MANIFEST, SUCCESS, verify_output
from tests.helpers.corpus import BAD_LINES, manifest, write_jsonl
from tests.helpers.stages import InProcess, plan_job, publish_job


class Broken(InProcess):
    """Planning raises an unexpected error for one job (a worker bug, a full disk...)."""

    def __init__(self, poisoned: str) -> None:
        super().__init__()
        self.poisoned = poisoned

    def plan(self, job: Job, idxs: list[int]) -> None:
        if job.id == self.poisoned:
            raise RuntimeError("planner crashed")
        super().plan(job, idxs)


def _job(tmp_path: Path, name: str, n: int = 60, objects: int = 2, **extra: object) -> str:
    for k in range(objects):
        write_jsonl(tmp_path / name / "in" / f"part-{k}.jsonl", n, seed=k, bad=(k == 0), prefix="r" if k == 0 else f"o{k}-")
    raw = manifest(str(tmp_path / name / "in") + "/", str(tmp_path / name / "out"), **extra)
    raw["name"] = name
    job_id, created = submit(parse_manifest(raw), OPERATOR)
    assert created
    return job_id


def test_plan_covers_every_record_once_and_is_deterministic(tmp_path: Path, tiny_bundle: str) -> None:
    job_id = _job(tmp_path, "p", n=150, shards={"max_records": 40})
    plan_job(job_id)
    job = jobs.get(job_id)
    assert job.status == JobStatus.RUNNING and job.records_total == 150 * 2 + len(BAD_LINES)
    planned = shards.of_job(job_id)
    assert sum(s.num_records for s in planned) == job.records_total
    assert all(s.num_records <= 40 for s in planned)
    errors = [s for s in planned if s.bucket == -1]
    assert sum(s.num_records for s in errors) == len(BAD_LINES)
    bounds = job.plan["bucket_bounds"]
    assert bounds == sorted(bounds) and len(bounds) >= 2
    # a second job over the same inputs gets the same shard layout (ids differ by job id only)
    other = _job(tmp_path, "p2", n=150, shards={"max_records": 40})
    plan_job(other)
    assert [(s.bucket, s.ordinal, s.num_records, s.num_tokens) for s in shards.of_job(other)] == \
        [(s.bucket, s.ordinal, s.num_records, s.num_tokens) for s in planned]


def test_execute_commits_one_shard_with_its_digest(tmp_path: Path, tiny_bundle: str) -> None:
    job_id = _job(tmp_path, "e")
    plan_job(job_id)
    shards.dispatch_ready(job_id)
    lease = leases.claim_next([job_id], "test:1", 30)
    result = execute_shard(lease)
    shard = shards.get(lease.shard_id)
    assert shard.status == ShardStatus.COMMITTED and shard.attempt == lease.attempt
    assert shard.output_sha256 == result.output_sha256 and shard.output_rows == result.output_rows
    assert result.output_rows + result.error_rows == shard.num_records
    assert pq.ParquetFile(shard.output_uri.removeprefix("file://")).metadata.num_rows == shard.output_rows


def test_verify_publishes_and_catches_a_tampered_part(tmp_path: Path, tiny_bundle: str) -> None:
    job_id = _job(tmp_path, "v")
    plan_job(job_id)
    shards.dispatch_ready(job_id)
    while (lease := leases.claim_next([job_id], "test:1", 30)) is not None:
        execute_shard(lease)
    assert shards.verify_when_done(job_id)
    m = publish_job(job_id)
    out = tmp_path / "v" / "out"
    assert (out / SUCCESS).exists() and json.loads((out / MANIFEST).read_text())["job_id"] == job_id
    c = m["counts"]
    assert c["records_succeeded"] + c["records_failed"] == c["records_total"] == 120 + len(BAD_LINES)
    assert verify_output(str(out))["ok"]
    part = next(out.glob("part-*.parquet"))
    part.write_bytes(part.read_bytes()[:-8] + b"tampered")
    with pytest.raises(VerificationError):
        verify_output(str(out))


def test_a_step_loop_runs_a_job_to_success_through_any_dispatcher(tmp_path: Path, tiny_bundle: str) -> None:
    job_id = _job(tmp_path, "s")
    d = InProcess()
    seen = []
    for _ in range(20):
        status = jobs.get(job_id).status
        seen.append(status)
        if status == JobStatus.SUCCEEDED:
            break
        assert step(job_id, d)
    assert seen[:3] == [JobStatus.SUBMITTED, JobStatus.PLANNING, JobStatus.PLANNING]
    assert JobStatus.RUNNING in seen and JobStatus.VERIFYING in seen and seen[-1] == JobStatus.SUCCEEDED
    assert sorted(d.planned) == [0, 1]
    assert all(s.status in SHARD_DONE for s in shards.of_job(job_id))


def test_one_failing_job_does_not_stop_the_others(tmp_path: Path, tiny_bundle: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINF_MAX_STEP_FAILURES", "3")
    monkeypatch.setenv("BATCHINF_STEP_RETRY_CAP", "0")     # a failed step runs again at the next tick
    from batchinf.config import settings

    settings.cache_clear()
    poisoned, healthy = _job(tmp_path, "bad"), _job(tmp_path, "good")
    controller = Controller(Broken(poisoned), max_in_flight=8)
    for _ in range(30):
        if {jobs.get(j).status for j in (poisoned, healthy)} <= {JobStatus.SUCCEEDED, JobStatus.FAILED}:
            break
        controller.tick()
        _resend_planning(poisoned)     # its planning tasks are due again at once
    bad, good = jobs.get(poisoned), jobs.get(healthy)
    assert good.status == JobStatus.SUCCEEDED
    assert bad.status == JobStatus.FAILED and bad.step_failures == 3
    assert "planning failed 3 times in a row" in bad.error and "planner crashed" in bad.error


def _resend_planning(job_id: str) -> None:
    """Make the job's planning tasks due again now (as if `requeue_seconds` had passed)."""
    from sqlalchemy import update

    from batchinf.ledger.db import tx
    from batchinf.ledger.tables import job_inputs

    with tx() as conn:
        conn.execute(update(job_inputs).where(job_inputs.c.job_id == job_id).values(dispatched_at=None))


def test_a_permanent_error_fails_the_job_at_once_with_the_stage(tmp_path: Path, tiny_bundle: str) -> None:
    raw = manifest(str(tmp_path / "nothing-here") + "/", str(tmp_path / "out"))
    job_id, _ = submit(parse_manifest(raw), OPERATOR)
    assert not step(job_id, InProcess())
    job = jobs.get(job_id)
    assert job.status == JobStatus.FAILED and job.error.startswith("pinning inputs failed: input ")
    assert "has no objects" in job.error


def test_cancel_requested_then_finished_by_the_next_step(tmp_path: Path, tiny_bundle: str) -> None:
    job_id = _job(tmp_path, "c")
    plan_job(job_id)
    assert cancel(job_id, finish=False) == JobStatus.CANCELLING     # the API only requests
    assert step(job_id, InProcess())                                  # the driver finishes
    job = jobs.get(job_id)
    assert job.status == JobStatus.CANCELLED and job.error == "cancelled by request"
    assert (tmp_path / "c" / "out" / "_PARTIAL.json").exists()
    assert not (tmp_path / "c" / "out" / SUCCESS).exists()
