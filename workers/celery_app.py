"""The Celery app: tasks carry only ids and call the same code as embedded mode.

Correctness comes from the ledger, not the broker: a task leases its shard in the ledger
(fencing token = attempt number), so a duplicate, late or replayed message does nothing.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from batchinf.config import settings

app = Celery("batchinf")
app.conf.update(
    task_serializer="json",
    accept_content=["json"],            # pickle messages are refused
    result_serializer="json",
    task_ignore_result=True,
    task_acks_late=True,                # ack after the shard ran, not when it was received
    task_reject_on_worker_lost=True,    # a killed worker's message goes back to the queue
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


def _from_settings() -> dict[str, Any]:
    """The broker, the queue and the visibility timeout, read when the app's configuration is
    first needed (sending or working), not at import. The visibility timeout is above the longest
    shard: an unacked message of a live worker is not redelivered meanwhile (a dead worker's shard
    is recovered sooner, through its expired ledger lease)."""
    s = settings()
    return {"broker_url": s.broker_url, "task_default_queue": s.queue,
            "broker_transport_options": {"visibility_timeout": s.visibility_timeout}}


app.add_defaults(_from_settings)


def __getattr__(name: str) -> Any:
    """QUEUE: the queue workers read (settings().queue), looked up when asked for."""
    if name == "QUEUE":
        return settings().queue
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@app.task(name="batchinf.execute_shard")
def execute_shard(shard_id: str, speculative: bool = False) -> None:
    from batchinf.dispatch import run_shard

    run_shard(shard_id, settings().device, speculative=speculative)


@app.task(name="batchinf.plan_object")
def plan_object(job_id: str, idx: int) -> None:
    from batchinf.plan import plan_object_task

    plan_object_task(job_id, idx)
