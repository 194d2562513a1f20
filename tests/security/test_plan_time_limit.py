"""Distributed planning under a time limit: a planning task that hangs is stopped by Celery at
BATCHINF_PLAN_TIME_LIMIT, counts as a failed attempt, and after BATCHINF_MAX_ATTEMPTS the job
fails naming the object -- it is never sent again for ever. (Real controller, worker, PostgreSQL,
Redis and S3, as in tests/integration/test_distributed.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchinf.ledger import jobs as job_repo
from tests.helpers.cluster import Cluster
from tests.helpers.cluster import job as _job
from tests.helpers.cluster import wait as _wait

pytestmark = pytest.mark.integration


def test_a_hanging_plan_task_is_stopped_and_fails_the_job(cluster: Cluster, tmp_path: Path,
                                                          s3_bucket: str) -> None:
    cluster.env.update(BATCHINF_PLAN_TIME_LIMIT="2", BATCHINF_MAX_ATTEMPTS="2")
    job_id, _ = _job(tmp_path, s3_bucket, n=20)
    cluster.controller()
    cluster.worker("w1", BATCHINF_FAILPOINTS="plan.object=sleep(600)")
    s = _wait(job_id, cluster, timeout=120)
    uri = job_repo.inputs(job_id)[0].pin.uri
    assert s["status"] == "failed", s
    assert s["error"] == (f"planning object {uri} failed 2 times: timed out after 2 s (BATCHINF_PLAN_TIME_LIMIT)")
    assert job_repo.inputs(job_id)[0].attempts == 2
