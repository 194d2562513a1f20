"""A hung S3 server in distributed mode: a private moto server SIGSTOPped while a worker pins a
job (the pinning task). The stuck call is logged with its job and object while it hangs, times out into a
TransientError (BATCHINF_S3_READ_TIMEOUT x BATCHINF_S3_MAX_ATTEMPTS), the step is retried, and
after SIGCONT the job succeeds with exactly-once coverage."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.cluster import exactly_once, job, start_cluster, wait
from tests.helpers.services import make_bucket, moto_process

pytestmark = [pytest.mark.integration, pytest.mark.chaos, pytest.mark.slow]

TIMEOUTS = {"BATCHINF_S3_CONNECT_TIMEOUT": "1", "BATCHINF_S3_READ_TIMEOUT": "1.5", "BATCHINF_S3_MAX_ATTEMPTS": "2",
            "BATCHINF_STORE_WARN_SECONDS": "1"}


def _wait_for_log(path: Path, *needles: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if all(n in ln for n in needles)]
        if lines:
            return lines[0]
        time.sleep(0.2)
    raise AssertionError(f"no line of {path.name} has {needles}:\n{path.read_text(errors='replace')[-4000:]}")


def test_paused_s3_is_logged_and_the_job_recovers(tmp_path: Path, bi_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with moto_process() as (_, moto):
        bucket = make_bucket(versioned=True)
        cluster = next(start_cluster(tmp_path, bucket, monkeypatch))
        try:
            cluster.env.update(TIMEOUTS)
            job_id, good = job(tmp_path, bucket, n=200, max_records=50)     # submitted; no controller yet
            cluster.worker("w1")
            os.kill(moto.pid, signal.SIGSTOP)
            try:
                cluster.controller()
                log = cluster.logs / "w1.log"          # pinning is a task on the workers, never the controller's tick
                stuck = _wait_for_log(log, "still waiting for s3 ", bucket, f"(job {job_id})")
                failed = _wait_for_log(log, f"job {job_id}: pinning inputs", "TransientError")
                print(f"\n{stuck}\n{failed}")
            finally:
                os.kill(moto.pid, signal.SIGCONT)
            wait(job_id, cluster, timeout=120)
            exactly_once(job_id, bucket, good)
        finally:
            cluster.stop_all()
