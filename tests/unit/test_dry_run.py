"""`batchinf plan` (a dry run): it plans a job held `planned` and reports it; the report agrees
with an ordinary planning of the same manifest (same shards, same counts), and running the
planned job executes exactly those shards without planning again."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchinf.cli import main
from batchinf.config import settings
from batchinf.dryrun import report, start
from batchinf.errors import LedgerError
from batchinf.ledger import jobs, shards
from batchinf.ledger.states import JobStatus
from batchinf.lifecycle import step
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from tests.helpers.corpus import BAD_LINES, manifest, write_jsonl
from tests.helpers.stages import InProcess, plan_job

N = 120


def _manifest(tmp_path: Path, **extra: object) -> dict:
    write_jsonl(tmp_path / "in" / "a.jsonl", N, seed=1)
    write_jsonl(tmp_path / "in" / "b.jsonl", N, seed=2, bad=False, prefix="b")
    return manifest(str(tmp_path / "in") + "/", str(tmp_path / "out"), shards={"max_records": 40}, **extra)


def _plan_cli(tmp_path: Path, raw: dict, *args: str) -> dict:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(raw))
    r = CliRunner().invoke(main, ["plan", str(path), "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _cut(job_id: str) -> list[tuple[int, int, int, int]]:
    return sorted((s.bucket, s.ordinal, s.num_records, s.num_tokens) for s in shards.of_job(job_id))


def test_plan_reports_what_an_ordinary_planning_of_the_manifest_cuts(tmp_path: Path, tiny_bundle: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINF_PRICE_PER_WORKER_HOUR", "3.6")
    settings.cache_clear()
    raw = _manifest(tmp_path)
    r = _plan_cli(tmp_path, raw, "--tokens-per-second", "50", "--workers", "2")

    job = jobs.get(r["job_id"])
    assert r["status"] == job.status == JobStatus.PLANNED and r["planned"]
    assert all(s.status == "pending" for s in shards.of_job(job.id))        # nothing dispatched
    # an ordinary planning of the same manifest (another idempotency key, output) for as many
    # workers cuts the same
    other, _ = submit(parse_manifest({**raw, "idempotency_key": "other", "output": {"uri": str(tmp_path / "o2")}}), OPERATOR)
    plan_job(other, workers=2)
    assert jobs.get(other).status == JobStatus.RUNNING
    assert _cut(job.id) == _cut(other)
    assert r["shards"] == len(_cut(other))
    assert r["bucket_bounds"] == jobs.get(other).plan["bucket_bounds"]

    codes = Counter(code for _, code in BAD_LINES)
    assert r["records"] == 2 * N + len(BAD_LINES) and r["invalid"] == len(BAD_LINES)
    assert r["invalid_by_code"] == dict(codes)
    assert sum(b["records"] for b in r["tokens"]["per_bucket"]) == 2 * N
    assert sum(b["tokens"] for b in r["tokens"]["per_bucket"]) == r["tokens"]["total"] \
        == sum(s.num_tokens for s in shards.of_job(job.id) if s.bucket >= 0)
    assert [b["max_tokens"] for b in r["tokens"]["per_bucket"]] == r["bucket_bounds"]
    assert 0.5 < r["padding_efficiency"] <= 1.0
    e = r["estimate"]
    assert e["throughput_source"] == "declared"
    assert e["worker_hours"] == pytest.approx(r["tokens"]["total"] / 50 / 3600)
    assert e["duration_seconds"] == pytest.approx(e["worker_hours"] * 3600 / 2)
    assert e["cost"] == pytest.approx(e["worker_hours"] * 3.6)

    # planning again reports the same job without planning it again
    assert _plan_cli(tmp_path, raw)["job_id"] == job.id
    assert jobs.get(job.id).plan_seconds == job.plan_seconds


def test_the_planned_job_runs_its_planned_shards_and_counts_match(tmp_path: Path, tiny_bundle: str) -> None:
    raw = _manifest(tmp_path)
    r = _plan_cli(tmp_path, raw)
    job_id = r["job_id"]
    assert r["estimate"]["worker_hours"] is None and r["estimate"]["throughput_source"] is None
    before = {s.id: (s.bucket, s.num_records) for s in shards.of_job(job_id)}

    assert step(job_id, InProcess())              # a held job: the lifecycle leaves it be
    assert jobs.get(job_id).status == JobStatus.PLANNED
    assert start(job_id) == JobStatus.RUNNING
    with pytest.raises(LedgerError, match="not planned"):
        start(job_id)
    for _ in range(20):
        if jobs.get(job_id).status == JobStatus.SUCCEEDED:
            break
        assert step(job_id, InProcess())
    assert jobs.get(job_id).status == JobStatus.SUCCEEDED
    assert {s.id: (s.bucket, s.num_records) for s in shards.of_job(job_id)} == before

    from batchinf.ledger.status import status

    st = status(job_id)
    assert st["counts"]["records_total"] == r["records"]
    assert st["shards"]["total"] == r["shards"] and st["shards"]["committed"] == r["shards"]
    assert st["errors"]["by_code"] == r["invalid_by_code"]
    assert st["tokens"]["input"] == r["tokens"]["total"]
    assert st["tokens"]["padding_efficiency"] == pytest.approx(r["padding_efficiency"], abs=0.02)

    # a later dry run of the same bundle uses the throughput measured by this job's attempts
    again = report(job_id)["estimate"]
    assert again["throughput_source"] == "measured" and again["measured_attempts"] == r["shards"]
    assert again["tokens_per_second"] > 0


@pytest.mark.slow
def test_batchinf_run_of_the_planned_manifest_does_not_plan_again(tmp_path: Path, tiny_bundle: str) -> None:
    raw = _manifest(tmp_path)
    r = _plan_cli(tmp_path, raw)
    ids = {s.id for s in shards.of_job(r["job_id"])}
    out = CliRunner().invoke(main, ["run", str(tmp_path / "job.json")])
    assert out.exit_code == 0, out.output
    assert f"running the job `batchinf plan` planned: {r['job_id']}" in out.output      # not "resuming"
    assert "resuming" not in out.output
    st = json.loads(CliRunner().invoke(main, ["status", r["job_id"], "--json"]).output)
    assert st["job_id"] == r["job_id"] and st["status"] == JobStatus.SUCCEEDED
    assert {s.id for s in shards.of_job(r["job_id"])} == ids
    assert st["counts"]["records_total"] == r["records"] and st["shards"]["total"] == r["shards"]
