"""Run single lifecycle stages by job id, as the drivers would, but letting their errors
propagate (the drivers charge them to the job instead)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from batchinf.dispatch import Dispatcher, plan_objects_here, run_shard
from batchinf.ledger import jobs, leases, shards
from batchinf.ledger.models import Job, Lease
from batchinf.ledger.states import JobStatus
from batchinf.planning import finish_plan, pin_job
from batchinf.verify import publish


def plan_job(job_id: str, processes: int = 1, workers: int | None = None) -> None:
    """submitted (or a crashed planning) -> running, its shards sized for `workers`."""
    if jobs.get(job_id).status == JobStatus.SUBMITTED:
        pin_job(jobs.get(job_id))
    job = jobs.get(job_id)
    if job.status != JobStatus.PLANNING:
        return
    plan_objects_here(job, [o.idx for o in jobs.inputs(job_id) if o.records is None], processes)
    finish_plan(jobs.get(job_id), workers)


def planned_shards(job_id: str) -> tuple[list[tuple], dict]:
    """Each shard's (bucket, ordinal, records, tokens, sha256 of its staged file) and the plan:
    what two plans of the same inputs must agree on."""
    out = []
    for s in sorted(shards.of_job(job_id), key=lambda s: (s.bucket, s.ordinal)):
        data = Path(s.input_uri.removeprefix("file://")).read_bytes()
        out.append((s.bucket, s.ordinal, s.num_records, s.num_tokens, hashlib.sha256(data).hexdigest()))
    return out, jobs.get(job_id).plan


def lease_one_shard(job_id: str, worker: str = "w:1") -> Lease:
    """Plan a job meant to be one shard (asserted) and lease that shard to `worker`."""
    plan_job(job_id)
    assert len(shards.of_job(job_id)) == 1
    shards.dispatch_ready(job_id)
    lease = leases.claim_next([job_id], worker, 30)
    assert lease is not None
    return lease


def publish_job(job_id: str) -> dict[str, Any]:
    return publish(jobs.get(job_id))


class InProcess(Dispatcher):
    """A real dispatcher that does the work where it is asked for: plans objects and runs shards
    in this process, the way a Celery worker would on receiving the message."""

    def __init__(self) -> None:
        super().__init__()
        self.planned: list[int] = []

    def plan(self, job: Job, idxs: list[int]) -> None:
        self.planned += idxs
        plan_objects_here(job, idxs, processes=1)

    def send(self, shard_ids: list[str]) -> None:
        for shard_id in shard_ids:
            run_shard(shard_id, "cpu")
