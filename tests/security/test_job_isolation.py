"""One poisoned job never stalls the others: a controller steps a healthy job beside jobs
poisoned each way that used to abort every tick (a binary input manifest; an output in a bucket
that does not exist, past a 1 s deadline). The healthy job succeeds; each poisoned one ends
failed or expired with its reason, within a bounded number of ticks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from batchinf.controller import Controller
from batchinf.ledger import jobs
from batchinf.ledger.states import JOB_TERMINAL, JobStatus
from batchinf.manifest import parse_manifest
from batchinf.scopes import Caller
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.stages import InProcess

pytestmark = pytest.mark.integration


def test_poisoned_jobs_end_with_their_reason_and_the_healthy_one_succeeds(
        tmp_path: Path, tiny_bundle: str, s3_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINF_MAX_STEP_FAILURES", "3")
    monkeypatch.setenv("BATCHINF_STEP_RETRY_CAP", "0")     # a failed step runs again at the next tick
    from batchinf.config import settings

    settings.cache_clear()
    write_jsonl(tmp_path / "good" / "a.jsonl", 40, bad=False)
    healthy, _ = submit(parse_manifest(manifest(str(tmp_path / "good") + "/", str(tmp_path / "out-good"),
                                                name="healthy")), OPERATOR)
    binary = tmp_path / "binary" / "objects.jsonl"
    binary.parent.mkdir()
    binary.write_bytes(bytes(range(256)) * 64)
    bad_manifest, _ = submit(parse_manifest(manifest(str(tmp_path / "x"), str(tmp_path / "out-binary"),
                                                     name="binary-manifest", input={"manifest": str(binary)})), OPERATOR)
    no_bucket, _ = submit(parse_manifest(manifest(str(tmp_path / "good") + "/", "s3://no-such-bucket-here/out/",
                                                  name="no-bucket", deadline="1s")), OPERATOR)
    time.sleep(1.1)
    controller = Controller(InProcess(), max_in_flight=8, tick_seconds=0)
    for _ in range(40):
        if all(jobs.get(j).status in JOB_TERMINAL for j in (healthy, bad_manifest, no_bucket)):
            break
        controller.tick()
    assert jobs.get(healthy).status == JobStatus.SUCCEEDED
    poisoned = jobs.get(bad_manifest)
    assert poisoned.status == JobStatus.FAILED and "not UTF-8 text" in poisoned.error and "objects.jsonl" in poisoned.error
    expired = jobs.get(no_bucket)
    assert expired.status == JobStatus.EXPIRED, expired
    assert "deadline passed" in expired.error and "no-such-bucket-here" in expired.error


class _Beside(InProcess):
    """InProcess whose pinning and planning a Controller runs beside its tick, as embedded
    `serve`'s WorkerPool does."""

    steps_beside_tick = True


def test_a_job_slow_to_pin_delays_only_itself(tmp_path: Path, tiny_bundle: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant's job listing many objects takes long to pin; another tenant's small job submitted
    after it finishes while it is still pinning (the controller's tick never waits on it)."""
    from batchinf import failpoints

    monkeypatch.setenv("BATCHINF_FAILPOINTS", "pin.object=sleep(0.15)")    # each object costs 0.15 s to pin
    failpoints.reload()
    for i in range(70):
        write_jsonl(tmp_path / "wide" / f"p{i:03d}.jsonl", 2, seed=i, bad=False)
    write_jsonl(tmp_path / "small" / "a.jsonl", 12, bad=False)
    wide, _ = submit(parse_manifest(manifest(str(tmp_path / "wide") + "/", str(tmp_path / "out-wide"), name="wide")),
                     Caller("initech", operator=True))
    small, _ = submit(parse_manifest(manifest(str(tmp_path / "small") + "/", str(tmp_path / "out-small"),
                                              name="small")), Caller("acme", operator=True))
    controller = Controller(_Beside(), max_in_flight=8, tick_seconds=0)
    started = time.monotonic()
    try:
        while jobs.get(small).status not in JOB_TERMINAL and time.monotonic() - started < 60:
            controller.tick()
            time.sleep(0.05)
        small_seconds, wide_then = time.monotonic() - started, jobs.get(wide).status
        while jobs.get(wide).status not in JOB_TERMINAL and time.monotonic() - started < 120:
            controller.tick()
            time.sleep(0.05)
    finally:
        controller.close()
        monkeypatch.delenv("BATCHINF_FAILPOINTS")
        failpoints.reload()
    assert jobs.get(small).status == JobStatus.SUCCEEDED
    assert wide_then == JobStatus.SUBMITTED, f"the wide job was {wide_then} when the small one ended"
    assert jobs.get(wide).status == JobStatus.SUCCEEDED
    print(f"small job beside a job pinning 70 objects: {small_seconds:.1f} s; the wide one: "
          f"{time.monotonic() - started:.1f} s")
