"""Dispatch in embedded mode: a local pool of worker processes that lease shards from the ledger.

Each worker is its own process, so a record that kills it kills only that worker: the driver
sees the exit, expires the dead worker's leases at once, and starts a replacement. The ledger is
the queue; there is no broker to lose messages.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from typing import Callable

from sqlalchemy import select

from batchinf import metrics
from batchinf.config import settings
from batchinf.ledger import ops
from batchinf.ledger.db import retrying, tx
from batchinf.ledger.states import SHARD_DONE, JobStatus, ShardStatus
from batchinf.ledger.tables import jobs, shards
from batchinf.plan import resolve_quarantined


def worker_name(pid: int | None = None) -> str:
    return f"{socket.gethostname()}:{pid or os.getpid()}"


def pick_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_lease(lease: ops.Lease, device: str, parent_pid: int | None = None) -> None:
    """Execute one leased shard; failures become retries, a bundle failure fails the job."""
    from batchinf.errors import BundleError, StaleAttemptError
    from batchinf.execute import Heartbeat, execute_shard

    hb = Heartbeat(lease, parent_pid)
    hb.start()
    try:
        execute_shard(lease, device=device, heartbeat=hb)
    except StaleAttemptError:
        metrics.attempt_ended("stale")        # another attempt owns the shard now
    except BundleError as exc:                # permanent: no retry can fix a bad bundle,
        ops.fail_attempt(lease, str(exc), max_attempts=0)   # so the shard and its job fail now
        metrics.attempt_ended("bundle")
    except Exception as exc:  # noqa: BLE001
        metrics.attempt_ended("error")
        retrying(ops.fail_attempt, lease, f"{type(exc).__name__}: {exc}", settings().max_attempts)
    finally:
        hb.stop()


def run_shard(shard_id: str, device: str = "auto", *, speculative: bool = False) -> None:
    """Distributed mode (a Celery task): lease the named shard and run it. A message for a shard
    that is not queued (duplicate delivery, already leased or committed) does nothing. A
    speculative message runs a straggler's twin attempt, unless this worker runs the original."""
    if speculative:
        lease = retrying(ops.claim_speculative, shard_id, worker_name())
    else:
        lease = retrying(ops.claim_shard, shard_id, worker_name(), settings().lease_seconds)
    if lease is not None:
        run_lease(lease, pick_device(device))


WAITING = (JobStatus.SUBMITTED, JobStatus.PLANNING, JobStatus.RUNNING)


def worker_main(job_id: str, device: str, threads: int, parent_pid: int) -> None:
    """Entry point of an embedded worker process: lease shards of one job until none are left.
    Started while the job is still planning, it loads the bundle meanwhile."""
    import signal

    import torch

    from batchinf.bundles import open_runtime
    from batchinf.errors import BundleError

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the driver's to handle
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    device = pick_device(device)
    me = worker_name()
    with tx() as conn:
        digest = conn.execute(select(jobs.c.bundle_digest).where(jobs.c.id == job_id)).scalar()
    try:
        open_runtime(digest, device=device)
    except BundleError:
        pass      # reported by the first shard that needs it, which fails the job
    next_speculation = 0.0
    while True:
        if os.getppid() != parent_pid:
            return
        lease = retrying(ops.claim_next, [job_id], me, settings().lease_seconds)
        if lease is None and time.monotonic() >= next_speculation:   # idle in the tail: stragglers?
            next_speculation = time.monotonic() + 1.0
            s = settings()
            for shard_id in retrying(ops.stragglers, job_id, s.speculate_factor, s.speculate_min_seconds):
                if (lease := retrying(ops.claim_speculative, shard_id, me)) is not None:
                    break
        if lease is None:
            with tx() as conn:
                status = conn.execute(select(jobs.c.status).where(jobs.c.id == job_id)).scalar()
            if status not in WAITING:
                return
            time.sleep(0.1)
            continue
        run_lease(lease, device, parent_pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dead_local_owners(job_id: str) -> list[str]:
    """Lease owners on this host whose process is gone (e.g. a previous `batchinf run` killed -9)."""
    host = socket.gethostname()
    with tx() as conn:
        owners = conn.execute(select(shards.c.lease_owner).distinct()
                              .where(shards.c.job_id == job_id,
                                     shards.c.status == ShardStatus.RUNNING.value)).scalars().all()
    dead = []
    for o in owners:
        h, _, pid = (o or "").rpartition(":")
        if h == host and pid.isdigit() and not _pid_alive(int(pid)):
            dead.append(o)
    return dead


class LocalPool:
    """N worker processes for one job; the driver ticks the ledger until the job leaves `running`."""

    def __init__(self, job_id: str, *, workers: int = 1, device: str = "auto",
                 threads: int | None = None) -> None:
        self.job_id, self.device, self.n = job_id, device, max(1, workers)
        self.threads = threads or max(1, (os.cpu_count() or 1) // self.n)
        self.ctx = mp.get_context("spawn")
        self.procs: list[mp.process.BaseProcess] = []

    def start(self) -> None:
        """Start the workers now (e.g. while the job plans), so their start-up overlaps planning."""
        while len(self.procs) < self.n:
            self._spawn()

    def _spawn(self) -> None:
        p = self.ctx.Process(target=worker_main, name="batchinf-worker",
                             args=(self.job_id, self.device, self.threads, os.getpid()), daemon=True)
        p.start()
        self.procs.append(p)

    def run(self, on_tick: Callable[[], None] | None = None, tick: float = 0.5) -> None:
        s = settings()
        ops.expire_leases(self.job_id, s.max_attempts, dead_owners=dead_local_owners(self.job_id))
        try:
            while True:
                ops.cancel_if_past_deadline(self.job_id)
                retrying(ops.dispatch_ready, self.job_id)
                dead = []
                for p in list(self.procs):
                    if not p.is_alive():
                        p.join()
                        self.procs.remove(p)
                        if p.exitcode != 0:
                            dead.append(worker_name(p.pid))
                retrying(ops.expire_leases, self.job_id, s.max_attempts, dead_owners=dead)
                resolve_quarantined(self.job_id)
                if retrying(ops.verify_when_done, self.job_id):
                    return
                with tx() as conn:
                    status = conn.execute(select(jobs.c.status).where(jobs.c.id == self.job_id)).scalar()
                    counts = ops.shard_counts(conn, self.job_id)
                if status != JobStatus.RUNNING:
                    return
                open_shards = sum(n for st, n in counts.items() if st not in SHARD_DONE)
                while len(self.procs) < min(self.n, open_shards):
                    self._spawn()
                if on_tick:
                    on_tick()
                time.sleep(tick)
        except BaseException:
            self.stop(timeout=0)
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for workers to finish (they exit once the job leaves running), then kill stragglers.
        Their leases, if any, expire and are taken over by the next driver."""
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs.clear()
