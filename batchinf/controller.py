"""The two drivers of the one lifecycle (lifecycle.py): `drive` runs one job on this machine
(embedded `batchinf run`) with a `WorkerPool` of its job; `Controller` steps every active job of a shared
ledger (`batchinf controller`) with the dispatcher it is given (Celery's, from `workers/`).
Either may be killed and started again at any point: everything is derived from the ledger.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from batchinf.bundles import release_planner
from batchinf.dispatch import Dispatcher, WorkerPool
from batchinf.errors import LedgerError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import leases
from batchinf.ledger import shards as shard_repo
from batchinf.ledger.models import Job
from batchinf.ledger.states import JOB_PLANNING, JOB_TERMINAL, JobStatus
from batchinf.lifecycle import advance, in_flight_cap, retry_in, share_slots, step

log = logging.getLogger("batchinf.controller")


def drive(job_id: str, *, workers: int = 1, device: str = "auto", threads: int | None = None,
          on_tick: Callable[[], object] | None = None, tick: float = 1.0, lanes: int = 1) -> str:
    """Run a job to a terminal state in this machine's processes; returns the final status. A
    running job is stepped every `tick` seconds and whenever a worker ends an attempt or idles; the
    step after the one that ends its running, at once.
    Each step reads the job once (`lifecycle.advance`); the loop goes by the status it leaves."""
    job = job_repo.get(job_id)
    # its job's engine, or EngineUnavailable
    pool = WorkerPool(job, workers=workers, device=device, threads=threads, lanes=lanes)
    try:
        if job.status in {JobStatus.RUNNING, JobStatus.PLANNED, *JOB_PLANNING}:
            pool.start()            # workers load the bundle while the job is pinned and planned
        status = job.status
        fresh: Job | None = job                 # the first step takes the job read above; each next one reads it
        while status not in JOB_TERMINAL:
            if status == JobStatus.PLANNED:     # planned by a dry run (`batchinf plan`): run its shards
                job_repo.release(job_id)
                fresh = None
            if reported := pool.worker_reports():     # before the step: publishing reads them
                job_repo.note_workers(job_id, reported)
                fresh = None
            ok, after = advance(fresh or job_repo.get(job_id), pool)
            fresh = None
            if status in JOB_PLANNING and after not in JOB_PLANNING:
                release_planner(job.bundle_digest)      # planned: its tokenizer is the workers' now
            if on_tick:
                on_tick()
            if not ok:
                time.sleep(retry_in(job_id))    # the step's backoff (lifecycle.retry_in)
            elif status == JobStatus.RUNNING and after in (JobStatus.RUNNING, JobStatus.CANCELLING):
                pool.wait(tick)         # until a worker reports; a job that left running (verifying,
                                        # or over) has its next step ready: taken now, not a tick later
            status = after
        pool.stop(timeout=0)        # the job is over: its workers hold no lease and have nothing to do
        return status
    except BaseException:
        pool.stop(timeout=0)
        raise


def cancel(job_id: str, reason: str = "cancelled by request", *, finish: bool = True) -> str:
    """Request cancellation. With `finish` (the CLI on the ledger's machine), also finish it here
    when no worker holds a live lease; otherwise the driver or controller running the job
    finishes it. Returns the job's status."""
    if not job_repo.request_cancel(job_id, reason):
        status = job_repo.status_of(job_id)
        if status != JobStatus.CANCELLING:
            raise LedgerError(f"job {job_id} is already {status}; nothing to cancel")
    if finish and leases.leases_held(job_id) == 0:
        step(job_id, Dispatcher())
    return job_repo.status_of(job_id)


def republish(job_id: str) -> str:
    """`batchinf verify --publish`: verify and publish again a job whose shards are all done, one
    still verifying or failed in verification or publishing (`ledger.jobs.reopen_for_publish`),
    stepped as `drive` steps it (the step budget and backoff); returns its final status. A
    succeeded job is left as it is: publishing is idempotent and already done."""
    job_repo.reopen_for_publish(job_id)
    status = job_repo.status_of(job_id)
    if status not in (JobStatus.VERIFYING, JobStatus.SUCCEEDED):
        raise LedgerError(f"job {job_id} is {status}: only a job that is verifying, or failed in verification, "
                          "is published again")
    return drive(job_id) if status == JobStatus.VERIFYING else status


SIDE_THREADS = 4     # a controller's threads for the pinning and planning steps it runs itself


class Controller:
    """Distributed mode's restartable loop over every active job in the ledger, highest priority
    first: per tick and job (under a controller lease, so two controllers never step one job at
    once), one lifecycle step, with at most `lifecycle.in_flight_cap` shards queued or running
    across the jobs of each route (engine and device: one fleet, fair share): `max_in_flight`, or
    fewer when that fleet is smaller, so shards queued for workers that are absent hold no slot
    of the workers that are there.

    Pinning and planning read what a tenant named, as much as it named: with a dispatcher that
    does that work in this process (`Dispatcher.steps_beside_tick`: embedded `serve`) those steps run
    beside the tick, one at a time per job and per tenant, so a slow or huge job delays only its
    own tenant's planning, never the other jobs' ticks (a broker's dispatcher sends tasks instead)."""

    def __init__(self, dispatcher: Dispatcher, *, name: str | None = None, max_in_flight: int = 16,
                 tick_seconds: float = 1.0) -> None:
        self.dispatcher = dispatcher
        self.name = name or f"controller@{socket.gethostname()}:{os.getpid()}"
        self.max_in_flight, self.tick_seconds = max_in_flight, tick_seconds
        self._side = ThreadPoolExecutor(SIDE_THREADS, thread_name_prefix="batchinf-step")
        self._beside: dict[str, tuple[str, Future]] = {}      # job -> (tenant, its step running beside the tick)

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            moved = False
            try:
                moved = self.tick()
            except Exception as exc:  # noqa: BLE001 -- ledger or broker down: try again next tick
                log.warning("controller tick failed, retrying: %s: %s", type(exc).__name__, exc)
            # a job that just changed status usually has its next step ready (submitted -> planning
            # -> plan tasks, verifying -> published): take it now, as `drive` does, not a tick later
            stop.wait(0 if moved else self.tick_seconds)

    def tick(self) -> bool:
        """One step of every active job; True when one of them changed status."""
        shares: dict[str, int] = {}
        demand = shard_repo.dispatch_demand(cap=self.max_in_flight)
        for route in sorted({d.route for d in demand}):   # each engine and device has its own fleet
            fleet = self.dispatcher.workers(route)
            # a broker's fleet not yet counted gets the margin alone; a dispatcher that counts no
            # workers and loses no messages (one that runs shards as it sends them) is not bounded
            cap = in_flight_cap(self.max_in_flight, fleet) if fleet or self.dispatcher.resends_lost \
                else self.max_in_flight
            shares.update(share_slots(cap, [d for d in demand if d.route == route]))
        moved = False
        self._beside = {j: (t, f) for j, (t, f) in self._beside.items() if not f.done()}
        for job_id in job_repo.active_ids():
            if job_id in self._beside:      # still stepping beside the tick: keep its lease
                job_repo.lock(job_id, self.name, max(30.0, 10 * self.tick_seconds))
                continue
            try:
                if job_repo.lock(job_id, self.name, max(30.0, 10 * self.tick_seconds)):
                    job = job_repo.get(job_id)
                    if job.status in JOB_PLANNING and self.dispatcher.steps_beside_tick:
                        self._step_beside(job)
                        continue
                    after = advance(job, self.dispatcher, slots=shares.get(job_id, 0)).status
                    moved = moved or after not in (job.status, *JOB_TERMINAL)
            except Exception as exc:  # noqa: BLE001 -- this job waits for the next tick; others go on
                log.warning("job %s: %s: %s", job_id, type(exc).__name__, exc)
        return moved

    def _step_beside(self, job: Job) -> None:
        """Step a job that is pinning or planning in a side thread, unless its tenant has one there."""
        if all(tenant != job.tenant for tenant, _ in self._beside.values()):
            self._beside[job.id] = (job.tenant, self._side.submit(advance, job, self.dispatcher))

    def close(self) -> None:
        """Wait for the steps running beside the tick."""
        self._side.shutdown(wait=True, cancel_futures=True)


def serve_embedded(stop: threading.Event, *, workers: int = 1, device: str = "auto", threads: int | None = None,
                   tick_seconds: float = 0.5, scheduler_interval: float = 30.0,
                   engines: tuple[str, ...] | None = None, lanes: int = 1) -> list[threading.Thread]:
    """What the jobs of an embedded (SQLite) ledger need, beside `batchinf serve`'s API: a
    controller loop over every active job, a pool of local worker processes that lease shards of
    any running job, and the scheduler. Returns the threads; setting `stop` ends them (and the
    workers)."""
    from batchinf.schedules import tick as schedule_tick

    pool = WorkerPool(workers=workers, device=device, threads=threads, engines=engines, lanes=lanes)
    controller = Controller(pool, name=f"serve@{socket.gethostname()}:{os.getpid()}",
                            max_in_flight=2 * max(1, workers * lanes), tick_seconds=tick_seconds)

    def run_controller() -> None:
        try:
            controller.run_forever(stop)
        finally:
            controller.close()
            pool.stop(timeout=5)

    def run_scheduler() -> None:
        while not stop.is_set():
            try:
                schedule_tick()
            except Exception as exc:  # noqa: BLE001 -- the next tick retries
                log.warning("scheduler tick failed: %s: %s", type(exc).__name__, exc)
            stop.wait(scheduler_interval)

    threads_ = [threading.Thread(target=run_controller, name="batchinf-controller", daemon=True),
                threading.Thread(target=run_scheduler, name="batchinf-scheduler", daemon=True)]
    for t in threads_:
        t.start()
    return threads_
