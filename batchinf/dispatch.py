"""Dispatch: how work reaches workers. The lifecycle (lifecycle.py) decides what runs; a
`Dispatcher` only delivers it. Two implementations share every step:

- `WorkerPool` (embedded `batchinf run` and `serve`): worker processes on this machine, one loop
  (`worker_main`), that lease shards from the ledger themselves (the ledger is the queue; no
  message can be lost). Each worker is its own process, so a record that kills it kills only that
  worker: its leases are expired at once and a replacement starts.
- the Celery dispatcher in `workers/` (distributed): shard and planning messages to a broker,
  sent again when they may have been lost.

`run_lease` and `run_shard` are what a worker does with a shard, in either mode.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import queue
import socket
import sys
import threading
import time
from typing import Any, Callable

from batchinf import failpoints, logs, metrics
from batchinf.config import settings
from batchinf.engines import ANY, DEVICES, Route
from batchinf.errors import AttemptReleased
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import leases
from batchinf.ledger import shards as shard_repo
from batchinf.ledger.events import now
from batchinf.ledger.models import Job, Lease
from batchinf.retry_policy import Action, RetryPolicy, retrying
from batchinf.lanes import LaneGate, usable_cores
from batchinf.runtime.threads import cuda_possible, set_worker_threads

log = logging.getLogger("batchinf.dispatch")


def worker_name(pid: int | None = None) -> str:
    return f"{socket.gethostname()}:{pid or os.getpid()}"


def pick_device(device: str) -> str:
    if device != "auto":
        return device
    if not cuda_possible():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Dispatcher:
    """The interface every driver steps jobs through; the defaults suit a dispatcher whose
    workers poll the ledger."""

    resends_lost = False          # messages may be lost (a broker): re-send stale queued shards
    steps_beside_tick = False     # a Controller runs pinning and planning steps beside its tick (WorkerPool)
    sweeps = True                 # delete losing attempts' files as the job runs (see lifecycle._sweep)
    requeue_seconds = 30.0        # ... and planning tasks older than this

    def __init__(self) -> None:
        self._speculated: dict[str, float] = {}   # straggler shard -> when its twin was asked for

    def pin(self, job: Job) -> None:
        """Pin a submitted job's inputs: here, now (one job's driver), or by sending a pinning task
        (a controller of many jobs, whose tick must not wait on one job's listing and hashing)."""
        from batchinf import planning

        planning.pin_job(job)

    def plan(self, job: Job, idxs: list[int]) -> None:
        """Stage these input objects of a planning job (now, or by sending planning tasks)."""
        raise NotImplementedError

    def send(self, shard_ids: list[str]) -> None:
        """These shards were just queued (or may have lost their message)."""

    def speculate(self, shard_id: str) -> None:
        """Ask for a speculative twin of a straggler, at most once per `requeue_seconds`."""
        if now() - self._speculated.get(shard_id, 0.0) > self.requeue_seconds:
            self._speculated[shard_id] = now()
            self._send_twin(shard_id)

    def _send_twin(self, shard_id: str) -> None:
        raise NotImplementedError

    def dead_workers(self, job: Job) -> list[str]:
        """Lease owners known to be dead (their leases are expired at once)."""
        return []

    def workers(self, route: Route | None = None) -> int | None:
        """Workers that can run a job on `route` (its engine and device: its shards are sized for
        them when it is planned now, and at most about that many are in flight); every worker for
        None; None: unknown."""
        return None

    def keep_up(self, job: Job, open_shards: int) -> None:
        """Called each running tick: keep enough workers for the job's open shards."""

    def quiesce(self, job: Job) -> bool:
        """True when no worker of this dispatcher can still commit for the (stopped) job."""
        return leases.leases_held(job.id) == 0

    def wait(self, seconds: float) -> None:
        """Between two steps of a running job: at most `seconds`, less when a worker reports."""
        time.sleep(seconds)


def run_lease(lease: Lease, device: str, parent_pid: int | None = None,
              nearly_done: Callable[[], None] | None = None, gate: LaneGate | None = None) -> None:
    """Execute one leased shard; what a failure means is the `RetryPolicy`'s to say. Its log lines
    carry job_id, shard_id and attempt. `nearly_done`: called as it starts the shard's last chunk.
    `gate`: the worker's lanes' (None: a worker of one lane)."""
    with logs.context(job_id=lease.job_id, shard_id=lease.shard_id, attempt=lease.attempt):
        _run_lease(lease, device, parent_pid, nearly_done, gate)


def _run_lease(lease: Lease, device: str, parent_pid: int | None, nearly_done: Callable[[], None] | None,
               gate: LaneGate | None) -> None:
    from batchinf.heartbeat import Heartbeat

    hb = Heartbeat(lease, parent_pid, nearly_done)     # first, before any heavy import or load
    hb.start()
    try:
        failpoints.hit("execute.load")
        from batchinf.execute import execute_shard

        log.info("shard %s attempt %d started", lease.shard_id, lease.attempt)
        with gate.turn(lease) if gate is not None else contextlib.nullcontext():
            result = execute_shard(lease, device=pick_device(device), heartbeat=hb)
        log.info("shard %s attempt %d committed: %d rows, %d error rows", lease.shard_id, lease.attempt,
                 result.output_rows, result.error_rows)
    except AttemptReleased as exc:              # its job stopped before it finished a record
        log.info("shard %s attempt %d released: %s", lease.shard_id, lease.attempt, exc)
        metrics.attempt_ended("released")
        retrying(leases.release_attempt, lease, str(exc))
    except Exception as exc:  # noqa: BLE001 -- every failure is classified and charged to its shard
        policy = RetryPolicy.from_settings()
        decision = policy.decide(exc, lease.attempt)
        log.warning("shard %s attempt %d ended: %s: %s", lease.shard_id, lease.attempt, type(exc).__name__, exc)
        if decision.action is Action.ABANDON:
            metrics.attempt_ended("stale")        # another attempt owns the shard now
        elif decision.action is Action.FAIL_JOB:  # no retry can fix a bad bundle or input,
            metrics.attempt_ended("bundle")       # so the shard and its job fail now
            policy.retrying(leases.fail_attempt, lease, str(exc), policy, give_up=True)
        else:                                     # the ledger's attempts decide (RetryPolicy.end_attempt)
            metrics.attempt_ended("error")
            policy.retrying(leases.fail_attempt, lease, f"{type(exc).__name__}: {exc}", policy)
    finally:
        hb.stop()


def run_shard(shard_id: str, device: str = "auto", *, speculative: bool = False, host: str | None = None) -> bool:
    """Distributed mode (a Celery task): lease the named shard and run it. A message for a shard
    that is not queued (duplicate delivery, already leased or committed) does nothing. A
    speculative message runs a straggler's twin attempt, unless this worker runs the original.
    `host`: this worker's failure domain (its Celery node). False when the shard's last attempt
    failed or lost its worker on this host and another host may take it (`leases.retry_elsewhere`):
    the caller hands the message back to the queue."""
    from batchinf.engines import worker_devices

    engines, device = settings().engines, pick_device(device)
    devices = worker_devices(device)
    if speculative:
        lease = retrying(leases.claim_speculative, shard_id, worker_name(), host, engines, devices)
    else:
        if host and retrying(leases.retry_elsewhere, shard_id, host, RetryPolicy.from_settings()):
            return False
        lease = retrying(leases.claim_shard, shard_id, worker_name(), settings().lease_seconds, host, engines,
                         devices)
    if lease is not None:
        run_lease(lease, device)
    return True


def plan_objects_here(job: Job, idxs: list[int], processes: int) -> None:
    """Stage objects on this machine, their planning parts in a process pool when there are
    several (planning.plan_objects)."""
    from batchinf import planning

    planning.plan_objects(job, idxs, processes)


PLAN_HERE_BYTES = 32 << 20   # a job's driver stages less input than this itself: a planning pool's start (~1.5 s
                             # on 2 cores) costs more than tokenizing or decoding it here
# A worker process is forked from its driver where nothing in the driver would break in the child:
# it then starts with the driver's imports (spawn re-imports them: about a CPU-second a worker on
# the critical path of a small job). These threads' state is reset in a forked child
# (store/watch.py); any other could hold a lock the child would wait on forever.
FORK_SAFE_THREADS = frozenset({"batchinf-store-watch"})
# ... and these libraries keep thread pools or device state that a fork leaves broken in the child
FORK_UNSAFE_MODULES = ("torch", "ctranslate2", "onnxruntime", "tokenizers", "vllm")
IDLE_RECHECK_SECONDS = 1.0   # an idle worker looks again this often unwoken (a driver that died, a missed wake)
POLL_SECONDS = 0.01          # how often a sleeping worker reads the signal's words


def start_method() -> str:
    """How a pool starts its next worker: 'fork' where this process runs no thread but the main one
    and FORK_SAFE_THREADS and has loaded none of FORK_UNSAFE_MODULES (a job's driver before it
    plans), else 'spawn'."""
    if "fork" not in mp.get_all_start_methods():
        return "spawn"
    others = {t.name for t in threading.enumerate() if t is not threading.main_thread()}
    if others <= FORK_SAFE_THREADS and not any(m in sys.modules for m in FORK_UNSAFE_MODULES):
        return "fork"
    return "spawn"


class WorkSignal:
    """Wakes idle workers when there may be work for them: the driver `notify`s as it queues
    shards, asks for a twin, or stops the workers (`close`). A worker notes the signal's count
    before it looks for work (`seen`) and `wait`s only while nothing came since, so no wake is
    missed between its look and its wait, and none makes it look twice.

    Lock-free on purpose: two shared words that only the driver writes, read by sleeping workers
    every `POLL_SECONDS`. A worker killed while it waits (or any time) can hold nothing the driver
    needs; a shared `Condition` could, and its `notify` then waited forever for the dead sleeper."""

    def __init__(self, ctx: Any) -> None:
        self._count = ctx.RawValue("Q", 0)
        self._closing = ctx.RawValue("b", 0)
        self._lock: threading.Lock | None = threading.Lock()   # the driver's threads, not the workers

    def __getstate__(self) -> dict[str, Any]:
        return {"_count": self._count, "_closing": self._closing, "_lock": None}

    def notify(self) -> None:
        assert self._lock is not None, "only the driver notifies"
        with self._lock:
            self._count.value += 1

    def close(self) -> None:
        self._closing.value = 1
        self.notify()

    def closed(self) -> bool:
        return bool(self._closing.value)

    def seen(self) -> int:
        return self._count.value

    def wait(self, seen: int, timeout: float = IDLE_RECHECK_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while self._count.value == seen and not self._closing.value:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(POLL_SECONDS, left))


class Wake:
    """A worker tells its driver "step the job now": one byte down a non-blocking pipe. Setting it
    never blocks (a full pipe is already set) and holds no lock, so a worker killed mid-`set`
    cannot stall the driver, as a shared `Event`'s lock could."""

    def __init__(self, ctx: Any) -> None:
        self._r, self._w = ctx.Pipe(duplex=False)
        for end in (self._r, self._w):      # the flag is the pipe's: the workers' copies of the end share it
            os.set_blocking(end.fileno(), False)

    def set(self) -> None:
        try:
            os.write(self._w.fileno(), b"!")
        except (BlockingIOError, BrokenPipeError):
            pass

    def wait(self, timeout: float) -> bool:
        """Up to `timeout` seconds for a wake; True if one came. Clears it."""
        woken = self._r.poll(timeout)
        try:
            while os.read(self._r.fileno(), 4096):
                pass
        except BlockingIOError:
            pass
        return woken


class Reports:
    """Workers tell their driver when they were ready and had their bundle loaded (the job's
    phases: batchinf/phases.py): one JSON line each down a non-blocking pipe, written whole (a
    line is far below the pipe's atomic size) and without a lock, like `Wake`. A full pipe (a
    driver that reads none: `serve`) drops the line."""

    def __init__(self, ctx: Any) -> None:
        self._r, self._w = ctx.Pipe(duplex=False)
        for end in (self._r, self._w):
            os.set_blocking(end.fileno(), False)
        self._partial = b""

    def send(self, report: dict[str, Any]) -> None:
        try:
            os.write(self._w.fileno(), json.dumps(report).encode() + b"\n")
        except (BlockingIOError, BrokenPipeError):
            pass

    def drain(self) -> list[dict[str, Any]]:
        """The reports sent since the last drain (the driver's side)."""
        data = self._partial
        try:
            while chunk := os.read(self._r.fileno(), 65536):
                data += chunk
        except BlockingIOError:
            pass
        *lines, self._partial = data.split(b"\n")
        return [json.loads(line) for line in lines if line]


def worker_main(job_ids: list[str] | None, bundle_digest: str | None, device: str, threads: int, parent_pid: int,
                twins: mp.Queue, work: WorkSignal, wake: Wake, engines: tuple[str, ...] = leases.NATIVE_ONLY,
                reports: Reports | None = None, lanes: int = 1) -> None:
    """Entry point of a `WorkerPool`'s process: lease shards of the given jobs (None: of any
    running job) until the parent exits or closes `work`; when idle, run a straggler's twin the
    driver asked for, else sleep until `work` wakes it. Started while its job is still planning,
    it loads the job's bundle (`bundle_digest`) meanwhile; bundles stay loaded per digest between
    jobs. It sets `wake` when it ends an attempt or first finds nothing to do, or starts the last
    chunk of its shard, so the driver steps the job at once (dispatch a split's halves, ask a
    running shard to split, verify) instead of at its next tick. It claims only shards of jobs
    on `engines` (the first one's runtime is the one it loads ahead) and on its device or any.
    It `reports` when it was ready (here: interpreter and imports done) and when it had the bundle
    loaded, for its job's phases. With `lanes` > 1 it runs that many leases at once, each on its
    own thread with `threads` threads, sharing the process's loaded bundles (`lanes.local_layout`)."""
    ready_at = time.time()
    import signal

    from batchinf.bundles import open_runtime
    from batchinf.engines import worker_devices

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the driver's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker would keep a server driver's handler
    if settings().log_format == "json":            # `batchinf --log-format json run`: these lines too
        logs.configure()
    set_worker_threads(threads, lanes)  # PyTorch gets them when a bundle that needs it loads
    device = pick_device(device)
    devices = worker_devices(device)
    me = worker_name()
    if bundle_digest is not None:
        try:
            open_runtime(bundle_digest, device=device, engine=engines[0])
        except Exception:  # noqa: BLE001 -- reported (and counted) by the first shard that needs it
            pass
        else:
            if reports is not None:
                reports.send({"worker": me, "ready_at": ready_at, "loaded_at": time.time()})
    gate = LaneGate() if lanes > 1 else None
    others = [threading.Thread(target=lease_loop, name=f"batchinf-lane-{i}", daemon=True,
                               args=(job_ids, device, devices, me, parent_pid, twins, work, wake, engines, gate))
              for i in range(1, lanes)]
    for t in others:
        t.start()
    lease_loop(job_ids, device, devices, me, parent_pid, twins, work, wake, engines, gate)
    for t in others:
        t.join()


def lease_loop(job_ids: list[str] | None, device: str, devices: tuple[str, ...], me: str, parent_pid: int,
               twins: mp.Queue, work: WorkSignal, wake: Wake, engines: tuple[str, ...],
               gate: LaneGate | None = None) -> None:
    """One lane of a worker: lease and run shards until the parent exits or closes `work`."""
    idle = False
    while os.getppid() == parent_pid and not work.closed():
        seen = work.seen()
        try:
            lease = retrying(leases.claim_next, job_ids, me, settings().lease_seconds, None, engines, devices)
            while lease is None:
                try:
                    lease = retrying(leases.claim_speculative, twins.get_nowait(), me, None, engines, devices)
                except queue.Empty:
                    break
        except Exception:  # noqa: BLE001 -- the ledger stays unavailable: look again when woken
            lease = None
        if lease is not None:
            run_lease(lease, device, parent_pid, wake.set, gate)
            idle = False
            wake.set()
        else:
            if not idle:
                wake.set()
            idle = True
            work.wait(seen)


def pid_alive(pid: int) -> bool:
    """Whether a process of this id exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkerPool(Dispatcher):
    """N worker processes on this machine that lease shards from the ledger themselves (the ledger
    is the queue; no message can be lost): of one `job` (embedded `batchinf run`, driven by
    `controller.drive`), or of every running job (`job` None: embedded `batchinf serve`, driven
    by `controller.Controller`, whose pinning and planning run in this process beside its tick).
    Each worker is its own process, so a record that kills it kills only that worker (and the
    shards its other `lanes` ran): its leases are expired at once and a replacement starts."""

    steps_beside_tick = True      # its pinning and planning read the tenants' objects in this process

    def __init__(self, job: Job | None = None, *, workers: int = 1, device: str = "auto",
                 threads: int | None = None, engines: tuple[str, ...] | None = None, lanes: int = 1) -> None:
        from batchinf.engines import pool_device, require

        super().__init__()
        self.job_ids = None if job is None else [job.id]
        self.bundle_digest = None if job is None else job.bundle_digest
        # one job's pool has its job's engine; a shared one the engines it is given (default: native)
        self.engines = require(engines or ((job.engine,) if job is not None else settings().engines))
        # one job's pool runs on its job's device, or is refused (DeviceUnavailableError) rather than wait forever
        self.device = device if job is None else pool_device(job.id, job.device, device)
        self.n, self.lanes = max(1, workers), max(1, lanes)
        self.threads = threads or max(1, usable_cores() // (self.n * self.lanes))
        # one job's pool sweeps nothing while the job runs: its zombies die with it, and publishing
        # deletes the whole work prefix anyway (lost attempts stay `lost` in the ledger)
        self.sweeps = job is None
        self.ctx = mp.get_context("spawn")
        self.procs: list[mp.process.BaseProcess] = []
        self.twins: mp.Queue = self.ctx.Queue()
        self.wake = Wake(self.ctx)       # set by a worker: step the job now (see worker_main)
        self.work = WorkSignal(self.ctx)
        self.dead: set[str] = set()
        self._checked: set[str] = set()  # jobs whose leases of an earlier process were looked at
        self.reports = Reports(self.ctx)   # one job's workers: ready and loaded (see `worker_reports`)
        self._spawned: dict[str, float] = {}   # worker name -> when its process was started
        self._named: set[str] = set()          # the workers `worker_reports` has named

    def start(self, n: int | None = None) -> None:
        """Start workers now, up to `n` (e.g. while the job plans, so their start-up overlaps it)."""
        while len(self.procs) < min(self.n, self.n if n is None else n):
            # the pool's queues and events are the spawn context's: a forked worker inherits them
            p = mp.get_context(start_method()).Process(target=worker_main, name="batchinf-worker", daemon=True,
                                 args=(self.job_ids, self.bundle_digest, self.device, self.threads, os.getpid(),
                                       self.twins, self.work, self.wake, self.engines,
                                       self.reports if self.job_ids else None, self.lanes))
            spawned = time.time()
            p.start()
            self.procs.append(p)
            self._spawned[worker_name(p.pid)] = spawned

    def worker_reports(self) -> dict[str, dict[str, float]]:
        """What the workers reported since the last call, by worker name (`spawned_at`, `ready_at`,
        `loaded_at`): the phase marks of a one-job pool's job (`ledger.jobs.note_workers`). With
        the first report, every worker spawned is named, so one still loading when a small job
        ends is listed too (up and idle, never ready), not left out. Nothing reported: nothing
        (the driver then keeps the job it read, one read a step)."""
        drained = self.reports.drain()
        if not drained:
            return {}
        out: dict[str, dict[str, float]] = {name: {"spawned_at": t} for name, t in self._spawned.items()
                                            if name not in self._named}
        self._named.update(out)
        for r in drained:
            name = r.pop("worker")
            out[name] = {**({"spawned_at": self._spawned[name]} if name in self._spawned else {}), **r}
        return out

    def plan(self, job: Job, idxs: list[int]) -> None:
        # one job's driver plans with every core, unless its input is so small that starting a pool
        # of planning processes costs more than staging it here; a server plans each job in one
        # process, beside its tick
        processes = (os.cpu_count() or 1) if self.job_ids else 1
        if processes > 1:
            sizes = {o.idx: o.pin.size for o in job_repo.inputs(job.id)}
            if sum(sizes.get(i, 0) for i in idxs) < PLAN_HERE_BYTES:
                processes = 1
        plan_objects_here(job, idxs, processes)

    def send(self, shard_ids: list[str]) -> None:
        self.work.notify()

    def _send_twin(self, shard_id: str) -> None:
        self.twins.put(shard_id)
        self.work.notify()

    def dead_workers(self, job: Job) -> list[str]:
        for p in list(self.procs):
            if not p.is_alive():
                p.join()
                self.procs.remove(p)
                if p.exitcode != 0:
                    self.dead.add(worker_name(p.pid))
        if job.id not in self._checked:   # leases of an earlier process on this host killed with -9
            self._checked.add(job.id)
            host = socket.gethostname()
            for owner in shard_repo.lease_owners(job.id):
                h, _, pid = owner.rpartition(":")
                if h == host and pid.isdigit() and not pid_alive(int(pid)):
                    self.dead.add(owner)
        return sorted(self.dead)

    def workers(self, route: Route | None = None) -> int | None:
        if route is not None and (route.engine not in self.engines
                                  or self.device in DEVICES and route.device not in (ANY, self.device)):
            return None
        return self.n * self.lanes

    def keep_up(self, job: Job, open_shards: int) -> None:
        self.start(-(-open_shards // self.lanes) if self.job_ids else None)

    def quiesce(self, job: Job) -> bool:
        # running attempts commit what they finished at their next batch (or give their lease
        # back), waking the driver; then the idle workers are stopped
        if not super().quiesce(job):
            return False
        if self.job_ids is not None:
            self.stop()
        return True

    def wait(self, seconds: float) -> None:
        self.wake.wait(seconds)

    def stop(self, timeout: float = 10.0) -> None:
        """Close the workers: an idle one exits now, a busy one after its attempt (which stops at
        its next heartbeat once its job has stopped); kill those still running after `timeout`.
        `timeout` 0: stop them now (SIGTERM): once their job is over and they hold nothing, or on
        Ctrl-C. Whatever leases they still held are then given back (`released`), so the next
        driver runs those shards at once, not after their leases expire."""
        self.work.close()
        stopped = [worker_name(p.pid) for p in self.procs]
        if timeout <= 0:
            for p in self.procs:     # all at once: each exits (frees its model) while the next is signalled
                p.terminate()
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs.clear()
        try:
            leases.release_workers(stopped, "its driver stopped (Ctrl-C or shutdown)")
        except Exception:  # noqa: BLE001 -- the ledger is down: the leases expire as they would have
            log.warning("could not give back the leases of stopped workers; they expire instead")
