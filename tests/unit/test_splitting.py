"""Dynamic splitting, stage by stage in this process: a running shard asked to split commits the
records it has done and hands the rest to new shards, fenced like every commit, so the job's
coverage stays exactly once, also when the split races a lease expiry or a speculative twin."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchinf.config import settings
from batchinf.dispatch import Dispatcher
from batchinf.errors import StaleAttemptError
from batchinf.execute import execute_shard
from batchinf.ledger import jobs, leases, shards, splits
from batchinf.ledger.models import Job, Lease
from batchinf.ledger.states import JobStatus, ShardStatus
from batchinf.lifecycle import step
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.verify import verify_output
from batchinf.retry_policy import RetryPolicy
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.stages import InProcess, lease_one_shard, plan_job

RECORDS = 60


class Idle(Dispatcher):
    """Two workers, both idle as far as the lifecycle knows: the test plays the one that runs."""

    def workers(self, route: object = None) -> int | None:
        return 2

    def plan(self, job: Job, idxs: list[int]) -> None:
        raise AssertionError("planned by the test")


@pytest.fixture(autouse=True)
def fine_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny corpus has few tokens: split at chunks of ~256 tokens, halves of any size."""
    monkeypatch.setenv("BATCHINF_SPLIT_CHUNK_TOKENS", "150")
    monkeypatch.setenv("BATCHINF_MIN_SHARD_TOKENS", "1")
    settings.cache_clear()


def _one_shard_job(tmp_path: Path, name: str = "s") -> tuple[str, Lease]:
    """A planned job of one shard, leased by worker `w:1`."""
    write_jsonl(tmp_path / name / "in.jsonl", RECORDS, seed=5, bad=False)
    raw = manifest(str(tmp_path / name / "in.jsonl"), str(tmp_path / name / "out"),
                   shards={"max_records": 4096}, options={"max_batch_tokens": 64})
    job_id, _ = submit(parse_manifest(dict(raw, name=name)), OPERATOR)
    return job_id, lease_one_shard(job_id)


def _finish(tmp_path: Path, job_id: str, name: str = "s") -> None:
    d, t0 = InProcess(), time.monotonic()
    while jobs.get(job_id).status != JobStatus.SUCCEEDED and time.monotonic() - t0 < 60:
        assert step(job_id, d)
        time.sleep(0.05)             # a retried shard waits out its backoff
    assert jobs.get(job_id).status == JobStatus.SUCCEEDED
    out = tmp_path / name / "out"
    assert verify_output(str(out))["ok"]                       # exactly-once coverage, digests
    ids = pq.read_table(out, columns=["record_id"], ignore_prefixes=["_", "errors"]).column("record_id")
    assert sorted(ids.to_pylist()) == sorted(f"r{i}" for i in range(RECORDS))


def test_an_idle_worker_gets_the_running_shard_split(tmp_path: Path, tiny_bundle: str) -> None:
    job_id, lease = _one_shard_job(tmp_path)
    assert step(job_id, Idle())                                # the running tick sees a worker idle
    parent = shards.get(lease.shard_id)
    assert parent.status == ShardStatus.RUNNING and splits.wanted(lease) == splits.SPLIT
    assert splits.request_split(job_id, 2, 1) == []            # asked once, not again
    result = execute_shard(lease)                              # splits at its first chunk boundary
    parent = shards.get(lease.shard_id)
    children = [s for s in shards.of_job(job_id) if s.parent_id == parent.id]
    assert parent.status == ShardStatus.COMMITTED and 0 < parent.num_records < RECORDS
    assert result.output_rows == parent.num_records
    assert len(children) == 2 and all(c.status == ShardStatus.PENDING for c in children)
    assert parent.num_records + sum(c.num_records for c in children) == RECORDS
    assert abs(children[0].num_tokens - children[1].num_tokens) <= 2 * max(c.num_tokens for c in children) / 3
    _finish(tmp_path, job_id)


def test_a_split_that_loses_its_lease_commits_nothing(tmp_path: Path, tiny_bundle: str) -> None:
    job_id, lease = _one_shard_job(tmp_path)
    assert splits.request_split(job_id, 2, 1) == [lease.shard_id]
    # the worker is declared dead while it computes: its lease expires, the shard is retried
    original = splits.commit_split

    def expire_then_commit(*args: object, **kw: object) -> None:
        leases.expire_leases(job_id, RetryPolicy.from_settings(max_attempts=5), dead_owners=["w:1"])
        original(*args, **kw)  # type: ignore[arg-type]

    splits.commit_split = expire_then_commit  # type: ignore[assignment]
    try:
        with pytest.raises(StaleAttemptError):
            execute_shard(lease)
    finally:
        splits.commit_split = original  # type: ignore[assignment]
    rows = shards.of_job(job_id)
    assert len(rows) == 1 and rows[0].status == ShardStatus.RETRYING and rows[0].num_records == RECORDS
    work = Path(jobs.get(job_id).work_uri.removeprefix("file://"))
    assert not list(work.rglob("split-*.parquet")) and not list(work.rglob("attempts/*/a1/*"))  # nothing left
    _finish(tmp_path, job_id)


@pytest.mark.parametrize("first", ["holder", "twin"])
def test_a_split_racing_a_speculative_twin_keeps_coverage_exactly_once(first: str, tmp_path: Path,
                                                                       tiny_bundle: str) -> None:
    job_id, holder = _one_shard_job(tmp_path)
    twin = leases.claim_speculative(holder.shard_id, "w:2")
    assert twin is not None
    splits.request_split(job_id, 2, 1)
    assert splits.wanted(holder) == splits.SPLIT and splits.wanted(twin) != splits.SPLIT   # only the holder splits
    winner, loser = (holder, twin) if first == "holder" else (twin, holder)
    execute_shard(winner)
    with pytest.raises(StaleAttemptError):
        execute_shard(loser)
    parent = shards.get(holder.shard_id)
    assert parent.status == ShardStatus.COMMITTED and parent.attempt == winner.attempt
    children = [s for s in shards.of_job(job_id) if s.parent_id == parent.id]
    assert (len(children) == 2) == (first == "holder")
    _finish(tmp_path, job_id)


@pytest.mark.parametrize("asker", ["driver", "worker"])
def test_a_worker_starting_its_last_chunk_counts_as_idle(asker: str, tmp_path: Path, tiny_bundle: str) -> None:
    """One worker per running shard, nothing waiting: no split while every shard has work; once
    one reports it is in its last chunk (its heartbeat's progress), the shard with the most work
    left is asked, never the nearly done one itself, by the driver (it knows the fleet) or by that
    worker (work stealing: it does not), and only once whoever asks next."""
    write_jsonl(tmp_path / "in.jsonl", RECORDS, seed=5, bad=False)
    raw = manifest(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), shards={"max_records": RECORDS // 2},
                   options={"max_batch_tokens": 64})
    job_id, _ = submit(parse_manifest(dict(raw, name="many")), OPERATOR)
    plan_job(job_id)
    shards.dispatch_ready(job_id)
    held = [leases.claim_next([job_id], f"w:{i}", 60.0) for i in range(len(shards.of_job(job_id)))]
    assert len(held) >= 2 and all(held)
    work = {lease.shard_id: shards.get(lease.shard_id).num_tokens for lease in held}
    nearly = max(held, key=lambda lease: shards.get(lease.shard_id).num_records)
    records = shards.get(nearly.shard_id).num_records
    chunk = -(-work[nearly.shard_id] // records)          # about its last record's work
    assert records > 1 and min(work.values()) > chunk
    n = len(held)
    assert splits.request_split(job_id, n, 1, soon_work=chunk) == []           # every worker busy
    assert leases.heartbeat(nearly, 60.0, records - 1)                        # its last record left
    assert splits.request_split(job_id, n, 1, soon_work=0) == []              # not counted without the lead
    asked = splits.request_split(job_id, n if asker == "driver" else None, 1, soon_work=chunk)
    others = {sid: w for sid, w in work.items() if sid != nearly.shard_id}
    assert asked == [max(others, key=lambda sid: (others[sid], sid))]
    assert splits.wanted(nearly) != splits.SPLIT
    assert splits.request_split(job_id, n, 1, soon_work=chunk) == []          # one idle worker, one split
    assert splits.request_split(job_id, None, 1, soon_work=chunk) == []


def test_execute_reports_progress_as_it_starts_the_last_chunk(tmp_path: Path, tiny_bundle: str) -> None:
    from batchinf.heartbeat import Heartbeat
    from batchinf.ledger.status import status

    job_id, lease = _one_shard_job(tmp_path)
    seen: list[int] = []
    hb = Heartbeat(lease, on_nearly_done=lambda: seen.append(status(job_id)["counts"]["records_done"]))
    execute_shard(lease, heartbeat=hb)                    # the heartbeat thread itself never started
    total = shards.get(lease.shard_id).num_records
    assert len(seen) == 1 and 0 < seen[0] < total          # once, with the records done before it
    _finish(tmp_path, job_id)
