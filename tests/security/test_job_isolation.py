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
from batchinf.submit import submit
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
                                                name="healthy")))
    binary = tmp_path / "binary" / "objects.jsonl"
    binary.parent.mkdir()
    binary.write_bytes(bytes(range(256)) * 64)
    bad_manifest, _ = submit(parse_manifest(manifest(str(tmp_path / "x"), str(tmp_path / "out-binary"),
                                                     name="binary-manifest", input={"manifest": str(binary)})))
    no_bucket, _ = submit(parse_manifest(manifest(str(tmp_path / "good") + "/", "s3://no-such-bucket-here/out/",
                                                  name="no-bucket", deadline="1s")))
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
