"""Embedded end to end: plan, execute in worker processes, verify, publish; DESIGN.md §2 invariants."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from sqlalchemy import select, update

from batchinf import failpoints
from batchinf.bundles import open_runtime
from batchinf.controller import drive
from batchinf.errors import StaleAttemptError, VerificationError
from batchinf.execute import execute_shard
from batchinf.ledger.jobs import get as job_row
from batchinf.ledger.status import status
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.ledger import leases as lease_repo
from batchinf.ledger import shards as shard_repo
from batchinf.ledger import jobs as job_repo
from batchinf.ledger.db import tx
from batchinf.ledger.states import JobStatus, ShardStatus
from batchinf.ledger.tables import job_events, shards
from batchinf.manifest import parse_manifest
from tests.helpers.stages import plan_job
from tests.helpers.stages import publish_job
from batchinf.verify import MANIFEST, SUCCESS, verify_output
from batchinf.retry_policy import RetryPolicy
from tests.helpers.corpus import BAD_LINES, manifest, write_jsonl

pytestmark = pytest.mark.integration


def read_output(out: Path) -> tuple[list[dict], list[dict]]:
    results = pq.read_table(out, columns=None, ignore_prefixes=["_", "errors"]).to_pylist() \
        if list(out.glob("part-*.parquet")) else []
    errors = pq.read_table(out / "errors").to_pylist() if (out / "errors").exists() else []
    return results, errors


@pytest.mark.slow
def test_job_embeds_every_record_exactly_once(tmp_path: Path, tiny_bundle: str) -> None:
    good = write_jsonl(tmp_path / "in" / "a.jsonl", 700, seed=1)
    good.update(write_jsonl(tmp_path / "in" / "b.jsonl", 300, seed=2, bad=False, prefix="b"))
    out = tmp_path / "out"
    job_id, created = submit(parse_manifest(manifest(str(tmp_path / "in") + "/", str(out))), OPERATOR)
    assert created
    assert drive(job_id, workers=2, threads=1) == JobStatus.SUCCEEDED

    results, errors = read_output(out)
    # exactly once: every (object, ordinal) of both inputs appears once across results + errors
    keys = [(r["source"], r["ordinal"]) for r in results + errors]
    assert len(keys) == len(set(keys)) == 700 + len(BAD_LINES) + 300
    assert sorted(r["record_id"] for r in results) == sorted(good)
    assert sorted(e["error"] for e in errors) == sorted(code for _, code in BAD_LINES)
    assert all(e["message"] for e in errors)
    bad_utf8 = next(e for e in errors if e["error"] == "invalid_utf8")
    assert "line 705" in bad_utf8["message"] and "a.jsonl" in bad_utf8["message"]

    # each result is the embedding of ITS record's text (no misaligned rows)
    runtime = open_runtime(tiny_bundle)
    sample = results[::37]
    want, _ = runtime.embed([e.ids for e in runtime.tokenizer.encode_batch([good[r["record_id"]] for r in sample])])
    got = np.asarray([r["embedding"] for r in sample], dtype=np.float32)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() > 0.9999

    m = json.loads((out / MANIFEST).read_text())
    for key in ("job_id", "bundle_digest", "inputs", "parts", "counts", "tokens", "timings", "created_at"):
        assert key in m
    assert m["bundle_digest"] == tiny_bundle
    assert m["counts"] == {"records_total": 1006, "records_succeeded": 1000, "records_failed": 6,
                           "records_truncated": m["counts"]["records_truncated"]}
    assert [i["records"] for i in m["inputs"]] == [706, 300]
    assert all(i["etag"] and i["size"] > 0 for i in m["inputs"])
    assert m["tokens"]["real"] == sum(r["input_tokens"] for r in results)
    assert m["tokens"]["real"] / m["tokens"]["padded"] > 0.9
    assert (out / SUCCESS).exists() and not (out / "_work").exists()
    assert verify_output(str(out))["ok"]
    s = status(job_id)
    assert s["counts"]["records_succeeded"] == 1000 and s["shards"]["committed"] == s["shards"]["total"]


def test_same_manifest_returns_same_job(tmp_path: Path, tiny_bundle: str) -> None:
    write_jsonl(tmp_path / "a.jsonl", 20)
    m = parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(tmp_path / "out"), idempotency_key="k1"))
    first, _ = submit(m, OPERATOR)
    again, created = submit(m, OPERATOR)
    assert (again, created) == (first, False)


@pytest.mark.slow
def test_success_only_when_complete(tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard that never commits fails the job after bounded attempts: no _MANIFEST, no _SUCCESS."""
    write_jsonl(tmp_path / "a.jsonl", 50, bad=False)
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.before_commit=raise")
    monkeypatch.setenv("BATCHINF_MAX_ATTEMPTS", "2")
    from batchinf.config import settings
    settings.cache_clear()
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(out))), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == JobStatus.FAILED
    assert "failed 2 attempts" in job_row(job_id).error
    assert not (out / SUCCESS).exists() and not (out / MANIFEST).exists()


def test_publish_refuses_a_missing_part(tmp_path: Path, tiny_bundle: str) -> None:
    write_jsonl(tmp_path / "a.jsonl", 50, bad=False)
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(out))), OPERATOR)
    plan_job(job_id)
    _execute_all(job_id)
    with tx() as conn:
        job_repo.transition(conn, job_id, JobStatus.VERIFYING)
        uri = conn.execute(select(shards.c.output_uri).where(shards.c.job_id == job_id)).scalars().first()
    Path(uri.removeprefix("file://")).unlink()
    with pytest.raises(VerificationError):
        publish_job(job_id)
    assert not (out / SUCCESS).exists()


def _execute_all(job_id: str) -> None:
    shard_repo.dispatch_ready(job_id)
    while (lease := lease_repo.claim_next([job_id], "test:1", 30)) is not None:
        execute_shard(lease)


def test_rerunning_stages_duplicates_nothing(tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path / "a.jsonl", 400, seed=3)
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(out))), OPERATOR)

    # plan crashes after pinning, then runs again: same shards, once
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "plan.after_pin=raise")
    failpoints.reload()
    with pytest.raises(failpoints.FailpointError):
        plan_job(job_id)
    monkeypatch.delenv("BATCHINF_FAILPOINTS")
    failpoints.reload()
    assert job_row(job_id).status == JobStatus.PLANNING
    plan_job(job_id)
    plan_job(job_id)      # no-op once running
    with tx() as conn:
        first = conn.execute(select(shards.c.id).where(shards.c.job_id == job_id).order_by(shards.c.id)).scalars().all()
    assert len(first) == len(set(first)) > 1

    # execute: a duplicate delivery of a committed shard does nothing
    _execute_all(job_id)
    assert lease_repo.claim_shard(first[0], "test:2", 30) is None
    shard_repo.dispatch_ready(job_id)
    assert lease_repo.claim_next([job_id], "test:2", 30) is None

    # verify: crash just before publishing, then publish again: same parts, once
    with tx() as conn:
        assert job_repo.transition(conn, job_id, JobStatus.VERIFYING)
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "verify.before_publish=raise")
    failpoints.reload()
    with pytest.raises(failpoints.FailpointError):
        publish_job(job_id)
    assert not (out / SUCCESS).exists()
    monkeypatch.delenv("BATCHINF_FAILPOINTS")
    failpoints.reload()
    m = publish_job(job_id)
    results, errors = read_output(out)
    assert len(results) + len(errors) == m["counts"]["records_total"] == 406
    assert len(list(out.glob("part-*.parquet"))) == sum(p["kind"] == "results" for p in m["parts"])
    with tx() as conn:
        commits = conn.execute(select(job_events.c.shard_id).where(
            job_events.c.job_id == job_id, job_events.c.to_status == "committed")).scalars().all()
    assert sorted(commits) == first


def test_stale_attempt_cannot_commit(tmp_path: Path, tiny_bundle: str) -> None:
    write_jsonl(tmp_path / "a.jsonl", 30, bad=False)
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(out))), OPERATOR)
    plan_job(job_id)
    shard_repo.dispatch_ready(job_id)
    zombie = lease_repo.claim_next([job_id], "zombie:1", 30)
    assert zombie is not None and zombie.attempt == 1
    # the zombie stops heartbeating; its lease expires and another worker takes the shard
    with tx() as conn:
        conn.execute(update(shards).where(shards.c.id == zombie.shard_id).values(lease_expires_at=0))
    assert lease_repo.expire_leases(job_id, RetryPolicy.from_settings(max_attempts=3)) == 1
    with tx() as conn:
        conn.execute(update(shards).where(shards.c.id == zombie.shard_id).values(not_before=0))
    shard_repo.dispatch_ready(job_id)
    winner = lease_repo.claim_next([job_id], "worker:2", 30)
    assert winner is not None and winner.shard_id == zombie.shard_id and winner.attempt == 2
    assert not lease_repo.heartbeat(zombie, 30)
    with pytest.raises(StaleAttemptError):
        execute_shard(zombie)
    assert not list((Path(job_row(job_id).work_uri.removeprefix("file://")) / "attempts" / zombie.shard_id).glob("a1"))
    execute_shard(winner)
    with tx() as conn:
        row = conn.execute(select(shards).where(shards.c.id == winner.shard_id)).one()
        assert row.status == ShardStatus.COMMITTED and "/a2/" in row.output_uri
        assert job_repo.transition(conn, job_id, JobStatus.VERIFYING)
    m = publish_job(job_id)
    assert all(p["shard"] == winner.shard_id for p in m["parts"])
    assert verify_output(str(out))["ok"]


@pytest.mark.slow
def test_verify_detects_tampered_output(tmp_path: Path, tiny_bundle: str) -> None:
    write_jsonl(tmp_path / "a.jsonl", 40, bad=False)
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "a.jsonl"), str(out))), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
    part = next(out.glob("part-*.parquet"))
    table = pq.read_table(part)
    pq.write_table(table.slice(1), part)            # a record vanished
    with pytest.raises(VerificationError):
        verify_output(str(out))
    from click.testing import CliRunner

    from batchinf.cli import main
    r = CliRunner().invoke(main, ["verify", job_id, "--json"])
    assert r.exit_code == 1 and json.loads(r.output)["ok"] is False


@pytest.mark.slow
def test_parquet_input_with_bad_rows(tmp_path: Path, tiny_bundle: str) -> None:
    import pyarrow as pa

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"doc": ["a", "b", None, "d", "a"], "body": ["one text", "", "no id", None, "dup"]}),
                   tmp_path / "in" / "x.parquet", row_group_size=2)
    pq.write_table(pa.table({"doc": ["z"], "other": ["wrong column"]}), tmp_path / "in" / "y.parquet")
    m = manifest(str(tmp_path / "in") + "/", str(tmp_path / "out"))
    m["input"].update(format="parquet", id_field="doc", text_field="body")
    job_id, _ = submit(parse_manifest(m), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
    results, errors = read_output(tmp_path / "out")
    assert [r["record_id"] for r in results] == ["a"]
    assert sorted(e["error"] for e in errors) == ["duplicate_id", "empty_text", "missing_column", "missing_id",
                                                  "missing_text"]
    s = status(job_id)["counts"]
    assert s["records_total"] == 6 == s["records_succeeded"] + s["records_failed"]


@pytest.mark.slow
def test_a_page_of_statuses_equals_each_job_status_at_a_constant_query_count(tmp_path: Path, tiny_bundle: str) -> None:
    from sqlalchemy import event

    from batchinf.ledger.status import page_jobs
    from batchinf.ledger.db import engine

    ids = []
    for i, n in enumerate((40, 60)):           # both with bad lines: error counts by code differ
        write_jsonl(tmp_path / f"in{i}.jsonl", n, seed=i)
        job_id, _ = submit(parse_manifest(manifest(str(tmp_path / f"in{i}.jsonl"), str(tmp_path / f"out{i}"),
                                                   shards={"max_records": 15})), OPERATOR)
        assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
        ids.append(job_id)
    write_jsonl(tmp_path / "in2.jsonl", 10)
    ids.append(submit(parse_manifest(manifest(str(tmp_path / "in2.jsonl"), str(tmp_path / "out2"))), OPERATOR)[0])
    statements: list[str] = []

    def count(*args: object) -> None:
        statements.append(str(args[2]))

    event.listen(engine(), "before_cursor_execute", count)
    try:
        page, _ = page_jobs(10)
        one_job = len(statements)
        page_jobs(1)
    finally:
        event.remove(engine(), "before_cursor_execute", count)
    assert [s["job_id"] for s in page] == ids[::-1]
    assert page == [status(j) for j in ids[::-1]]
    assert page[1]["errors"]["records"] > 0 and page[2]["shards"]["total"] > 0 and page[0]["shards"]["total"] == 0
    assert len(statements) - one_job == one_job, "a page of 3 jobs took more queries than a page of 1"
