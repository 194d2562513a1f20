"""Chaos while a finished job verifies and publishes on S3: an injected storage fault, and an S3
server paused mid-publish. Either way the job must end `succeeded` on its own, with every record
published exactly once: a storage fault is transient in verification as everywhere."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from batchinf.controller import drive
from batchinf.ledger import jobs
from batchinf.verify import verify_output
from tests.helpers import services
from tests.helpers.publishing import published_ids, set_failpoints, small_job, while_verifying

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def test_a_storage_fault_while_verifying_ends_succeeded_on_its_own(
        tmp_path: Path, tiny_bundle: str, s3_bucket: str) -> None:
    out = f"{s3_bucket}/out"
    job_id, ids = small_job(tmp_path, out)
    failures: list[int] = []

    def fault(n: int) -> None:
        """Every read of the store fails from the moment the job is verifying, for two steps."""
        failures.append(jobs.get(job_id).step_failures)
        set_failpoints("store.get=raise" if n <= 2 else None)
    try:
        final = drive(job_id, workers=1, threads=1, on_tick=while_verifying(job_id, fault))
    finally:
        set_failpoints(None)
    job = jobs.get(job_id)
    assert final == "succeeded", job.error
    assert max(failures) == 2, failures          # the fault was met, twice, and retried
    assert job.step_failures == 0
    assert verify_output(out)["ok"]
    assert sorted(published_ids(out)) == sorted(ids)


def test_a_paused_s3_server_while_verifying_ends_succeeded(tmp_path: Path, tiny_bundle: str) -> None:
    """The job's own moto server is stopped (SIGSTOP) as the job becomes verifying and resumed
    (SIGCONT) 4 s later: publishing waits for it, or fails and is retried, and succeeds."""
    with services.moto_process() as (_, proc):
        out = f"{services.make_bucket(versioned=True)}/out"
        job_id, ids = small_job(tmp_path, out)
        paused: list[float] = []

        def pause(n: int) -> None:
            if n == 1:
                os.kill(proc.pid, signal.SIGSTOP)
                paused.append(time.monotonic())
                threading.Timer(4.0, os.kill, (proc.pid, signal.SIGCONT)).start()
        try:
            final = drive(job_id, workers=1, threads=1, on_tick=while_verifying(job_id, pause))
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        job = jobs.get(job_id)
        assert paused, "the job was never seen verifying; nothing was paused"
        print(f"published {time.monotonic() - paused[0]:.1f} s after the S3 server was paused for 4 s")
        assert final == "succeeded", job.error
        assert verify_output(out)["ok"]
        assert sorted(published_ids(out)) == sorted(ids)
