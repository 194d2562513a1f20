"""Drive jobs through their stages: plan -> dispatch/execute -> verify/publish (or, once
cancelled or past their deadline, -> _PARTIAL.json).

`drive` runs one job on this machine (embedded `batchinf run`); `Controller` steps every active
job of a shared ledger for Celery workers (`batchinf controller`). Every step reads the job's
state from the ledger and is safe to re-run after a crash, so either resumes by running again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Callable

from sqlalchemy import select, update

from batchinf import metrics
from batchinf.config import settings
from batchinf.dispatch import LocalPool
from batchinf.errors import LedgerError, TransientError, VerificationError
from batchinf.jobs import job_row
from batchinf.ledger import ops
from batchinf.ledger.db import retrying, tx
from batchinf.ledger.ops import fail_job, now
from batchinf.ledger.states import ATTEMPT_LOSERS, JOB_ACTIVE, JOB_TERMINAL, AttemptStatus, JobStatus
from batchinf.ledger.tables import attempts, job_inputs, jobs, shards
from batchinf.plan import (failing_job_on_permanent_error, finish_plan, pin_job, plan_or_fail,
                           resolve_quarantined)
from batchinf.store import get_store, join
from batchinf.verify import publish, publish_partial

log = logging.getLogger("batchinf.controller")


def share_slots(max_in_flight: int, demand: list[ops.Demand]) -> dict[str, int]:
    """Fair share of the fleet's free dispatch slots: `max_in_flight` shards may be queued or
    running across all jobs; free slots go to jobs by priority, then earliest deadline, and
    round-robin between jobs that tie, each up to what it has ready. A big low-priority backfill
    therefore holds at most the slots it already has when an urgent job arrives, and gets no new
    ones while the urgent job is being planned or has shards ready."""
    free = max(0, max_in_flight - sum(d.in_flight for d in demand))
    shares = {d.job_id: 0 for d in demand}
    by_class: dict[tuple[int, float], list[ops.Demand]] = {}
    for d in demand:
        by_class.setdefault((-d.priority, d.deadline_at or float("inf")), []).append(d)
    for key in sorted(by_class):
        group = sorted(by_class[key], key=lambda d: d.created_at)
        while free and any(shares[d.job_id] < d.ready for d in group):
            for d in group:
                if free and shares[d.job_id] < d.ready:
                    shares[d.job_id] += 1
                    free -= 1
    return shares


def drive(job_id: str, *, workers: int = 1, device: str = "auto", threads: int | None = None,
          on_tick: Callable[[], None] | None = None) -> str:
    """Run a job to a terminal state in this machine's processes; returns the final status."""
    pool = LocalPool(job_id, workers=workers, device=device, threads=threads)
    try:
        while True:
            ops.cancel_if_past_deadline(job_id)
            status = job_row(job_id).status
            if status in JOB_TERMINAL:
                return status
            if status in (JobStatus.SUBMITTED, JobStatus.PLANNING):
                pool.start()            # workers load the bundle while we plan
                retrying(plan_or_fail, job_id)
            elif status == JobStatus.RUNNING:
                pool.run(on_tick)
            elif status == JobStatus.VERIFYING:
                pool.stop()
                try:
                    retrying(publish, job_id)
                except VerificationError as exc:
                    fail_job(job_id, f"verification failed: {exc}")
            else:   # cancelling: our workers stop at their next heartbeat
                pool.stop()
                finish_stopped(job_id)
            if on_tick:
                on_tick()
    finally:
        pool.stop()


def finish_stopped(job_id: str) -> None:
    """cancelling -> cancelled/expired once no attempt can still commit: leases released,
    committed parts promoted, `_PARTIAL.json` written."""
    ops.release_leases(job_id)
    publish_partial(job_id)


def cancel(job_id: str, reason: str = "cancelled by request") -> str:
    """Request cancellation; finish it here when no worker holds a live lease (otherwise the
    driver or controller running the job finishes it). Returns the job's status."""
    if not ops.request_cancel(job_id, reason) and job_row(job_id).status != JobStatus.CANCELLING:
        raise LedgerError(f"job {job_id} is already {job_row(job_id).status}; nothing to cancel")
    if job_row(job_id).status == JobStatus.CANCELLING and ops.leases_held(job_id) == 0:
        finish_stopped(job_id)
    return job_row(job_id).status


class Controller:
    """Distributed mode's restartable loop over every active job in the ledger.

    Per tick and job (under a controller lease, so two controllers never step one job at once):
    pin submitted jobs; send one planning task per input object and run the global planning
    step when all are staged; keep at most `max_in_flight` shards queued or running; expire
    leases of silent workers; send again any queued shard whose message may be lost; verify and
    publish finished jobs; delete the files of attempts that lost. All of it is derived from the
    ledger on every tick, so a controller may be killed and restarted at any point.
    """

    def __init__(self, *, name: str | None = None, max_in_flight: int = 16,
                 requeue_seconds: float = 30.0, tick_seconds: float = 1.0,
                 send_shard: Callable[..., None] | None = None,
                 send_plan: Callable[[str, int], None] | None = None) -> None:
        self.name = name or f"controller@{socket.gethostname()}:{os.getpid()}"
        self.max_in_flight, self.requeue_seconds, self.tick_seconds = max_in_flight, requeue_seconds, tick_seconds
        if send_shard is None or send_plan is None:
            from workers import celery_app

            send_shard = send_shard or (lambda sid, speculative=False: celery_app.execute_shard.apply_async(
                args=[sid], kwargs={"speculative": True} if speculative else {}))
            send_plan = send_plan or (lambda jid, idx: celery_app.plan_object.apply_async(args=[jid, idx]))
        self.send_shard, self.send_plan = send_shard, send_plan
        self._speculated: dict[str, float] = {}      # straggler shard -> when its twin was sent

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 -- ledger or broker down: try again next tick
                log.warning("controller tick failed, retrying: %s: %s", type(exc).__name__, exc)
            stop.wait(self.tick_seconds)

    def tick(self) -> None:
        with tx() as conn:
            active = conn.execute(select(jobs.c.id).where(jobs.c.status.in_([s.value for s in JOB_ACTIVE]))
                                  .order_by(jobs.c.priority.desc(), jobs.c.created_at)).scalars().all()
        shares = share_slots(self.max_in_flight, ops.dispatch_demand())
        for job_id in active:
            try:
                if ops.lock_job(job_id, self.name, max(30.0, 10 * self.tick_seconds)):
                    self.step(job_id, slots=shares.get(job_id, 0))
            except TransientError as exc:     # this job waits for the next tick; others go on
                log.warning("job %s: %s", job_id, exc)

    def step(self, job_id: str, slots: int | None = None) -> None:
        ops.cancel_if_past_deadline(job_id)
        status = job_row(job_id).status
        if status == JobStatus.SUBMITTED:
            with failing_job_on_permanent_error(job_id, "pinning inputs"):
                pin_job(job_id)
        elif status == JobStatus.PLANNING:
            with failing_job_on_permanent_error(job_id, "planning"):
                self._plan(job_id)
        elif status == JobStatus.RUNNING:
            self._run(job_id, self.max_in_flight if slots is None else slots)
            self._sweep(job_id)
        elif status == JobStatus.VERIFYING:
            try:
                publish(job_id)
            except VerificationError as exc:
                fail_job(job_id, f"verification failed: {exc}")
        elif status == JobStatus.CANCELLING and ops.leases_held(job_id) == 0:
            finish_stopped(job_id)   # workers saw the cancel at their heartbeat; leases ran out

    def _plan(self, job_id: str) -> None:
        with tx() as conn:
            rows = conn.execute(select(job_inputs).where(job_inputs.c.job_id == job_id)
                                .order_by(job_inputs.c.idx)).all()
        if all(r.records is not None for r in rows):
            finish_plan(job_id, [r.records for r in rows])
            return
        for r in rows:
            if r.records is None and (r.dispatched_at is None or r.dispatched_at < now() - self.requeue_seconds):
                self.send_plan(job_id, r.idx)
                with tx() as conn:
                    conn.execute(update(job_inputs).where(job_inputs.c.job_id == job_id, job_inputs.c.idx == r.idx)
                                 .values(dispatched_at=now()))

    def _run(self, job_id: str, slots: int) -> None:
        metrics.leases_expired(ops.expire_leases(job_id, settings().max_attempts))
        resolve_quarantined(job_id)
        if ops.verify_when_done(job_id):
            return
        fresh = ops.dispatch_ready(job_id, limit=slots) if slots > 0 else []
        resend = [s for s in ops.stale_queued(job_id, self.requeue_seconds) if s not in fresh]
        for shard_id in fresh + resend:
            self.send_shard(shard_id)
        ops.mark_dispatched(fresh + resend)
        metrics.shards_sent(len(fresh), len(resend))
        self._speculate(job_id)

    def _speculate(self, job_id: str) -> None:
        """One twin message per straggler; a worker that runs the original ignores it, and a lost
        message is sent again after `requeue_seconds`."""
        s = settings()
        for shard_id in ops.stragglers(job_id, s.speculate_factor, s.speculate_min_seconds):
            if now() - self._speculated.get(shard_id, 0.0) > self.requeue_seconds:
                self.send_shard(shard_id, speculative=True)
                self._speculated[shard_id] = now()

    def _sweep(self, job_id: str) -> None:
        """Delete the files of attempts that lost (their worker died or was fenced off) once their
        shard is committed, so no zombie can still be writing them."""
        with tx() as conn:
            work = conn.execute(select(jobs.c.work_uri).where(jobs.c.id == job_id)).scalar()
            losers = conn.execute(select(attempts.c.shard_id, attempts.c.number)
                                  .join(shards, shards.c.id == attempts.c.shard_id)
                                  .where(shards.c.job_id == job_id, shards.c.status == "committed",
                                         attempts.c.status.in_([s.value for s in ATTEMPT_LOSERS]))).all()
        for shard_id, number in losers:
            base = join(work, "attempts", shard_id, f"a{number}")
            get_store(base).delete_prefix(base)
            with tx() as conn:
                ops.end_attempt(conn, shard_id, number, AttemptStatus.SWEPT)
