"""A dry run (`batchinf plan`): pin and plan a job without executing it, and report what it will
cost. The job is submitted held: planning ends `planned` instead of `running`, its shards cut and
staged, and `batchinf run` of the same manifest (or `batchinf start JOB`) runs exactly those
shards without planning again.

The estimate divides the job's input tokens by a throughput for its bundle: declared
(`--tokens-per-second`), else measured from the committed attempts of earlier jobs of the same
bundle in this ledger (input tokens per worker-second); times BATCHINF_PRICE_PER_WORKER_HOUR it
is a cost.
"""

from __future__ import annotations

import time
from typing import Any

from batchinf.config import settings
from batchinf.dispatch import Dispatcher, plan_objects_here
from batchinf.engines import Route
from batchinf.errors import LedgerError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger.models import Job
from batchinf.ledger.states import JOB_PLANNING, JobStatus
from batchinf.ledger.status import bundle_throughput, status
from batchinf.lifecycle import step
from batchinf.manifest import JobManifest
from batchinf.retry_policy import RetryPolicy, Stage
from batchinf.scopes import Caller
from batchinf.submit import submit
from batchinf.tasks import get_task


class PlanHere(Dispatcher):
    """Plans objects in this process's pool; a dry run never sends shards. Its shards are sized
    for `workers` (sizing.py)."""

    def __init__(self, processes: int, workers: int | None = None) -> None:
        super().__init__()
        self.processes, self.n = processes, workers

    def workers(self, route: Route | None = None) -> int | None:
        return self.n

    def plan(self, job: Job, idxs: list[int]) -> None:
        plan_objects_here(job, idxs, self.processes)


def plan_only(manifest: JobManifest, caller: Caller, *, processes: int = 1, workers: int | None = None) -> str:
    """Submit the manifest held and plan it here; returns the job id. A manifest whose job exists
    already is not planned again: a held one still planning is planned on, any other is reported
    as it stands. `workers`: the workers its shards are sized for (None: by the caps alone)."""
    job_id, _ = submit(manifest, caller, hold=True)
    dispatcher, failures = PlanHere(max(1, processes), workers), 0
    while (job := job_repo.get(job_id)).hold and job.status in JOB_PLANNING:
        if step(job_id, dispatcher):
            failures = 0
        else:       # charged to the job (lifecycle); it fails after BATCHINF_MAX_STEP_FAILURES
            failures += 1
            time.sleep(RetryPolicy.from_settings().backoff(Stage.CALL, failures))
    return job_id


def start(job_id: str, *, tenant: str | None = None) -> str:
    """planned -> running: the controller (or `batchinf run`) executes the planned shards."""
    job = job_repo.get(job_id, tenant=tenant)
    if job.status != JobStatus.PLANNED or not job_repo.release(job_id):
        raise LedgerError(f"job {job_id} is {job.status}, not planned; only a job planned by `batchinf plan` "
                          "waits to be started")
    return job_repo.get(job_id).status


def report(job_id: str, *, tokens_per_second: float | None = None, workers: int = 1,
           tenant: str | None = None) -> dict[str, Any]:
    """What planning found (records, invalid records by code, tokens in total and per bucket,
    bucket bounds, shards, estimated padding efficiency; for transcribe, the audio in hours: its
    tokens are seconds of audio) and, given a throughput, the worker
    time, wall time on `workers` workers and cost of executing it."""
    job = job_repo.get(job_id, tenant=tenant)
    st = status(job_id, tenant=tenant)
    p = job.plan
    planned = job.status not in JOB_PLANNING and bool(p)
    out: dict[str, Any] = {"job_id": job_id, "status": job.status, "planned": planned, "error": job.error}
    if not planned:
        return out
    buckets = p.get("buckets", [])
    tokens, padded = sum(b["tokens"] for b in buckets), int(p.get("padded_tokens", 0))
    out |= {
        "objects": p.get("objects"), "records": p.get("records"), "invalid": p.get("invalid"),
        "invalid_by_code": p.get("invalid_by_code", {}), "truncated": p.get("truncated"),
        "tokens": {"total": tokens, "per_bucket": buckets,      # invalid records' tokens are not computed
                   "in_invalid_records": int(p.get("tokens", 0)) - tokens},
        "bucket_bounds": p.get("bucket_bounds", []), "shards": st["shards"]["total"],
        "padding_efficiency": tokens / padded if padded else None,
        "plan_seconds": job.plan_seconds,
        **get_task(job.task).summarize_plan(tokens),
        "estimate": estimate(job, tokens, tokens_per_second, workers),
        "next": (f"batchinf start {job_id}, or batchinf run with the same manifest"
                 if job.status == JobStatus.PLANNED else None),
    }
    return out


def estimate(job: Job, tokens: int, tokens_per_second: float | None, workers: int) -> dict[str, Any]:
    """Worker-hours, wall seconds and cost of `tokens` input tokens at the declared or measured
    throughput; the fields are None when neither is known (or no price is set)."""
    source, attempts = "declared", None
    if not tokens_per_second:
        measured = bundle_throughput(job.bundle_digest)
        tokens_per_second, attempts = measured or (None, 0)
        source = "measured" if measured else None
    price = settings().price_per_worker_hour
    worker_hours = tokens / tokens_per_second / 3600 if tokens_per_second else None
    return {"tokens_per_second": tokens_per_second, "throughput_source": source, "measured_attempts": attempts,
            "workers": workers, "worker_hours": worker_hours,
            "duration_seconds": worker_hours * 3600 / max(1, workers) if worker_hours is not None else None,
            "price_per_worker_hour": price,
            "cost": worker_hours * price if worker_hours is not None and price is not None else None}
