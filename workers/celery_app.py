"""The Celery app: tasks carry only ids and call the same code as embedded mode.

Correctness comes from the ledger, not the broker: a task leases its shard in the ledger
(fencing token = attempt number), so a duplicate, late or replayed message does nothing.
"""

from __future__ import annotations

import os

from celery import Celery

from batchinf.config import settings
from batchinf.dispatch import Dispatcher
from batchinf.ledger.models import Job

QUEUE = os.environ.get("BATCHINF_QUEUE", "batchinf")
# Above the longest shard: an unacked message of a live worker is not redelivered meanwhile.
# (A dead worker's shard is recovered sooner, through its expired ledger lease.)
VISIBILITY_TIMEOUT = int(os.environ.get("BATCHINF_VISIBILITY_TIMEOUT", 6 * 3600))

app = Celery("batchinf")
app.conf.update(
    broker_url=settings().broker_url,
    task_serializer="json",
    accept_content=["json"],            # pickle messages are refused
    result_serializer="json",
    task_ignore_result=True,
    task_acks_late=True,                # ack after the shard ran, not when it was received
    task_reject_on_worker_lost=True,    # a killed worker's message goes back to the queue
    worker_prefetch_multiplier=1,
    task_default_queue=QUEUE,
    broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="batchinf.execute_shard")
def execute_shard(shard_id: str, speculative: bool = False) -> None:
    from batchinf.dispatch import run_shard

    run_shard(shard_id, os.environ.get("BATCHINF_DEVICE", "auto"), speculative=speculative)


@app.task(name="batchinf.plan_object")
def plan_object(job_id: str, idx: int) -> None:
    from batchinf.plan import plan_one_object

    plan_one_object(job_id, idx)


class CeleryDispatcher(Dispatcher):
    """The controller's dispatcher: planning and shard messages through the broker. Messages may
    be lost (a flushed or restarted broker), so the lifecycle sends stale ones again; a duplicate
    does nothing, because a worker leases its shard in the ledger."""

    resends_lost = True

    def __init__(self, requeue_seconds: float = 30.0) -> None:
        super().__init__()
        self.requeue_seconds = requeue_seconds

    def plan(self, job: Job, idxs: list[int]) -> None:
        for idx in idxs:
            plan_object.apply_async(args=[job.id, idx])

    def send(self, shard_ids: list[str]) -> None:
        for shard_id in shard_ids:
            execute_shard.apply_async(args=[shard_id])

    def _send_twin(self, shard_id: str) -> None:
        execute_shard.apply_async(args=[shard_id], kwargs={"speculative": True})
