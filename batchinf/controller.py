"""Drive a job through its stages: plan -> dispatch/execute -> verify/publish.

Every step reads the job's state from the ledger and is safe to re-run after a crash, so the
embedded `batchinf run` resumes a killed run by calling `drive` again.
"""

from __future__ import annotations

from typing import Callable

from batchinf.dispatch import LocalPool
from batchinf.errors import VerificationError
from batchinf.jobs import job_row
from batchinf.ledger.ops import fail_job
from batchinf.ledger.states import JOB_TERMINAL, JobStatus
from batchinf.plan import plan_or_fail
from batchinf.verify import publish


def drive(job_id: str, *, workers: int = 1, device: str = "auto", threads: int | None = None,
          on_tick: Callable[[], None] | None = None) -> str:
    """Run a job to a terminal state in this machine's processes; returns the final status."""
    pool = LocalPool(job_id, workers=workers, device=device, threads=threads)
    try:
        while True:
            status = job_row(job_id).status
            if status in JOB_TERMINAL:
                return status
            if status in (JobStatus.SUBMITTED, JobStatus.PLANNING):
                pool.start()            # workers load the bundle while we plan
                plan_or_fail(job_id)
            elif status == JobStatus.RUNNING:
                pool.run(on_tick)
            elif status == JobStatus.VERIFYING:
                pool.stop()
                try:
                    publish(job_id)
                except VerificationError as exc:
                    fail_job(job_id, f"verification failed: {exc}")
            else:   # cancelling: nothing runs in embedded mode once the driver stops
                return status
            if on_tick:
                on_tick()
    finally:
        pool.stop()
