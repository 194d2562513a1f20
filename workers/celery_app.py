"""The Celery app: tasks carry only ids and call the same code as embedded mode.

Correctness comes from the ledger, not the broker: a task leases its shard in the ledger
(fencing token = attempt number), so a duplicate, late or replayed message does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator

from billiard.exceptions import WorkerLostError
from celery import Celery, Task
from celery.signals import setup_logging
from celery.worker.request import Request

from batchinf.config import settings
from batchinf.dispatch import Dispatcher
from batchinf.engines import Route
from batchinf.ledger import attempts as attempt_repo
from batchinf.ledger.models import Job

RECENT_WORKER_SECONDS = 600.0    # a worker that ran an attempt this recently counts as live
FLEET_REFRESH_SECONDS = 10.0     # how often the controller asks the broker which workers consume the queue
FLEET_RETRY_SECONDS = 2.0        # ... and, while none answered, how soon it asks again
log = logging.getLogger("batchinf.workers")

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


@setup_logging.connect
def _logging(**_: Any) -> None:
    """Celery logs through batchinf's one configuration (text or JSON, `batchinf --log-format`)."""
    from batchinf import logs

    logs.configure()


def _from_settings() -> dict[str, Any]:
    """The broker, the queue and the timeouts, read when the app's configuration is first needed
    (sending or working), not at import. The visibility timeout is above the longest shard: an
    unacked message of a live worker is not redelivered meanwhile (a dead worker's shard is
    recovered sooner, through its expired ledger lease). Every broker call is bounded by
    BATCHINF_BROKER_TIMEOUT: socket connect and read timeouts (Redis; AMQP's connect timeout), and
    a publish retries for about as long, then raises (the controller's step fails and is retried;
    the ledger still holds the shard queued, so a message never sent is sent again)."""
    s = settings()
    t = s.broker_timeout
    return {"broker_url": s.broker_url, "task_default_queue": s.queue,
            "broker_connection_timeout": t,
            "broker_transport_options": {"visibility_timeout": s.visibility_timeout,
                                         "socket_timeout": t, "socket_connect_timeout": t},
            "task_publish_retry_policy": {"max_retries": 3, "interval_start": 0,
                                          "interval_step": t / 6, "interval_max": t / 3}}


def plan_queue() -> str:
    """The queue planning tasks go to (BATCHINF_QUEUE + "-plan"), which every worker also reads:
    an urgent job's planning never waits behind a backfill's shard messages, only for a free
    worker process."""
    return f"{settings().queue}-plan"


app.add_defaults(_from_settings)


def __getattr__(name: str) -> Any:
    """QUEUE: the queue workers read (settings().queue), looked up when asked for."""
    if name == "QUEUE":
        return settings().queue
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ShardRequest(Request):
    """A shard task's request in the worker's main process: when the pool process running it dies
    (WorkerLostError: killed, OOM, segfault), its lease is released at once (`leases.release_dead`)
    instead of when it expires, so the shard is retried now. Celery requeues the message
    (task_reject_on_worker_lost), and sends no task_failure signal for it: hence this hook."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)                  # an ExceptionWithTraceback
        stopped = getattr(self, "_already_cancelled", False) or getattr(self, "_already_revoked", False)
        if self.worker_pid and isinstance(exc, (WorkerLostError, SystemExit)) and not stopped:
            _release_dead(self.worker_pid, str(exc) or type(exc).__name__)
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


def _release_dead(pid: int, why: str) -> None:
    from batchinf.dispatch import worker_name
    from batchinf.ledger import leases
    from batchinf.retry_policy import RetryPolicy

    try:
        n = RetryPolicy.from_settings(call_attempts=3).retrying(leases.release_dead, [worker_name(pid)], why)
    except Exception as exc:  # noqa: BLE001 -- the lease then expires as before
        log.warning("could not release the lease of dead pool process %d: %s", pid, exc)
        return
    log.warning("pool process %d died (%s): %d lease(s) released", pid, why, n)


@app.task(name="batchinf.execute_shard", bind=True, Request=ShardRequest)
def execute_shard(self: Task, shard_id: str, speculative: bool = False) -> None:
    """Run the shard on this worker, whose node name (`--hostname`) is the attempt's host; a shard
    that should retry on another host (`dispatch.run_shard` False) goes back to the queue."""
    from batchinf.dispatch import run_shard
    from batchinf.retry_policy import RetryPolicy

    if not run_shard(shard_id, settings().device, speculative=speculative, host=self.request.hostname):
        execute_shard.apply_async(args=[shard_id], countdown=RetryPolicy.from_settings().elsewhere_countdown,
                                  queue=_queues([shard_id])[shard_id])


@app.task(name="batchinf.pin_job")
def pin_job(job_id: str) -> None:
    """Pin a submitted job's inputs on a worker. Pinning itself fails the job past
    BATCHINF_PIN_TIME_LIMIT (planning.pin.Bounds); the task's own limits, a little later, stop a call
    stuck inside one object (a failed step, charged to the job)."""
    from batchinf.lifecycle import pin_now

    pin_now(job_id)


@app.task(name="batchinf.plan_object")
def plan_object(job_id: str, idx: int) -> None:
    """Plan one object; a large one's parts (planning/ranges.py) are sent as `plan_part` tasks."""
    from batchinf.planning import plan_one_object

    with _timed_out(job_id, idx):
        plan_one_object(job_id, idx, send_parts=lambda parts: _send_parts(job_id, idx, parts))


@app.task(name="batchinf.plan_part")
def plan_part(job_id: str, idx: int, k: int) -> None:
    from batchinf.planning import plan_sent_part

    with _timed_out(job_id, idx):
        plan_sent_part(job_id, idx, k)


def _send_parts(job_id: str, idx: int, parts: list[int]) -> None:
    limit = settings().plan_time_limit     # soft: the task records the timeout; hard: it is killed
    for k in parts:
        plan_part.apply_async(args=[job_id, idx, k], queue=plan_queue(), soft_time_limit=limit, time_limit=limit + 30)


@contextlib.contextmanager
def _timed_out(job_id: str, idx: int) -> Iterator[None]:
    """A planning task stopped at its soft time limit fails its object's attempt, saying so."""
    from celery.exceptions import SoftTimeLimitExceeded

    from batchinf.ledger import jobs as job_repo

    try:
        yield
    except SoftTimeLimitExceeded:
        job_repo.plan_attempt_failed(job_id, idx, f"timed out after {settings().plan_time_limit:g} s "
                                                  "(BATCHINF_PLAN_TIME_LIMIT)")
        raise


class CeleryDispatcher(Dispatcher):
    """The controller's dispatcher: planning and shard messages through the broker. Messages may
    be lost (a flushed or restarted broker), so the lifecycle sends stale ones again; a duplicate
    does nothing, because a worker leases its shard in the ledger."""

    resends_lost = True

    def __init__(self, requeue_seconds: float = 30.0) -> None:
        super().__init__()
        self.requeue_seconds = requeue_seconds
        self._fleet: dict[str, tuple[float, int]] = {}         # queue -> (when counted, worker processes up)
        self._pinning: dict[str, float] = {}                   # job -> when its pinning task was sent

    def pin(self, job: Job) -> None:
        """Send the job's pinning task, again only after `requeue_seconds` (a lost message)."""
        if time.monotonic() - self._pinning.get(job.id, float("-inf")) > self.requeue_seconds:
            self._pinning[job.id] = time.monotonic()
            limit = settings().pin_time_limit + 15
            pin_job.apply_async(args=[job.id], queue=plan_queue(), soft_time_limit=limit, time_limit=limit + 30)

    def plan(self, job: Job, idxs: list[int]) -> None:
        limit = settings().plan_time_limit     # soft: the task records the timeout; hard: it is killed
        for idx in idxs:
            plan_object.apply_async(args=[job.id, idx], queue=plan_queue(), soft_time_limit=limit,
                                    time_limit=limit + 30)

    def send(self, shard_ids: list[str]) -> None:
        """Each shard to the queue of its job's engine and device (engines.queue_of), read only by
        workers that have them."""
        for shard_id, queue in _queues(shard_ids).items():
            execute_shard.apply_async(args=[shard_id], queue=queue)

    def _send_twin(self, shard_id: str) -> None:
        for shard_id, queue in _queues([shard_id]).items():
            execute_shard.apply_async(args=[shard_id], kwargs={"speculative": True}, queue=queue)

    def workers(self, route: Route | None = None) -> int | None:
        """The live fleet on `route`: pool processes of the workers that consume its queue (its
        engine and device; every worker for None: they all read the planning queue), asked every
        FLEET_REFRESH_SECONDS, or the workers that ran attempts of jobs on it lately if more; None
        when neither knows of any (a cold fleet): a job is then cut by its caps unless its manifest
        names `shards.target_workers`."""
        from batchinf.engines import queue_of

        queue = plan_queue() if route is None else queue_of(settings().queue, *route)
        asked, up = self._fleet.get(queue, (float("-inf"), 0))
        if time.monotonic() - asked > (FLEET_REFRESH_SECONDS if up else FLEET_RETRY_SECONDS):
            ran = attempt_repo.recent_workers(RECENT_WORKER_SECONDS, route)
            up = max(processes_up(queue), ran)
            self._fleet[queue] = (time.monotonic(), up)
        return up or None


def _queues(shard_ids: list[str]) -> dict[str, str]:
    from batchinf.engines import queue_of
    from batchinf.ledger import shards as shard_repo

    if not shard_ids:
        return {}
    routes = shard_repo.routes_of(shard_ids)
    return {s: queue_of(settings().queue, *routes.get(s, Route())) for s in shard_ids}


def engine_queues(engines: tuple[str, ...], device: str) -> list[str]:
    """The shard queues a worker with these engines on `device` (cpu or cuda) reads."""
    from batchinf.engines import worker_queues

    return worker_queues(settings().queue, engines, device)


def processes_up(queue: str) -> int:
    """Pool processes of the workers that answer on the broker now and consume `queue` (0 when
    the broker cannot be asked). Two broadcasts: which workers consume what (active_queues, its
    reply awaited a tenth of BATCHINF_BROKER_TIMEOUT), then the pool size of those that consume
    `queue` (stats, addressed to them, so it returns once they replied)."""
    timeout = settings().broker_timeout / 10
    try:
        consumed = app.control.inspect(timeout=timeout).active_queues() or {}
        names = [w for w, qs in consumed.items() if any(q.get("name") == queue for q in qs or [])]
        if not names:
            return 0
        stats = app.control.inspect(destination=names, timeout=timeout).stats() or {}
    except Exception:  # noqa: BLE001 -- the broker is down: the ledger's view stands
        return 0
    return sum(int(((stats.get(w) or {}).get("pool") or {}).get("max-concurrency") or 1) for w in names)
