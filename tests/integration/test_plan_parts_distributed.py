"""Distributed planning of a large object in parts: the object's planning task sends its parts
as tasks of their own, two Celery workers plan them, and the job covers every record exactly
once. (Real controller, workers, PostgreSQL, Redis and S3, as in test_distributed.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchinf.ledger import jobs as job_repo
from tests.helpers.cluster import Cluster, exactly_once, job, wait

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_two_workers_plan_the_parts_of_one_object(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    cluster.env.update(BATCHINF_PLAN_RANGE_BYTES="2000")
    job_id, good = job(tmp_path, s3_bucket, n=300)
    assert (tmp_path / "in.jsonl").stat().st_size > 10 * 2000
    cluster.controller()
    cluster.worker("w1")
    cluster.worker("w2")
    wait(job_id, cluster)
    exactly_once(job_id, s3_bucket, good)
    [obj] = job_repo.inputs(job_id)
    assert (obj.records, obj.attempts) == (len(good) + 6, 1)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("w*.log"))
    assert logs.count("batchinf.plan_part") >= 10, cluster.log_tail()
