"""Lanes: how one job's local pool lays this machine's cores out into worker processes, lanes (shards
a process runs at once, a thread each, sharing its loaded model) and threads (`local_layout`), and
the gate by which a process's lanes run a shard that may kill the process alone (`LaneGate`)."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

from batchinf.ledger import shards as shard_repo
from batchinf.ledger.models import Job, Lease
from batchinf.retry_policy import retrying
from batchinf.runtime.threads import cuda_possible


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:          # no affinity on this platform
        return os.cpu_count() or 1


def local_layout(job: Job, device: str = "auto", workers: int | None = None, lanes: int | None = None,
                 threads: int | None = None) -> tuple[int, int, int]:
    """How one job's `WorkerPool` spreads over this machine's cores: (worker processes, lanes per
    process, threads per lane); what is given is kept, the rest fills the cores. By default a
    process per core with one thread (on CPU it measures faster than one process of every thread:
    docs/performance), except a job on the CPU with the native engine whose task says
    `lanes_on_cpu` (generate): one process with a lane per core. Its lanes decode nearly as fast as
    processes (a decode step's kernels release the GIL) and hold the decoder's weights, PyTorch and
    the tokenizer once: 0.90x the tokens/s of two processes in 0.61x the memory
    (docs/performance/generate_vs_llama_server.md)."""
    from batchinf.tasks import get_task

    cores = usable_cores()
    on_cpu = device == "cpu" or (device == "auto" and job.device != "cuda" and not cuda_possible())
    if workers is None and lanes is None and threads is None and on_cpu and job.engine == "native" \
            and get_task(job.task).lanes_on_cpu:
        return 1, cores, 1
    lanes = lanes or 1
    workers = workers or max(1, cores // (lanes * (threads or 1)))
    return workers, lanes, threads or max(1, cores // (workers * lanes))


class LaneGate:
    """What the lanes of one worker process share: a shard whose records may kill the process
    (`shards.may_kill_its_worker`) runs `alone`, the others `together`. Sharing a process, a lane's
    shard dies with whatever kills it, and a one-record shard that loses its worker is declared
    poison: run beside the shard that kills, an innocent record would be. A shard waiting for
    its turn holds its lease (heartbeating) but computes nothing, so a loss then is not charged."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._together = 0              # shards running beside each other
        self._alone = False             # a shard running alone
        self._waiting = 0               # shards waiting to run alone: no new shard starts beside them

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone and not self._waiting)
            self._together += 1
        try:
            yield
        finally:
            with self._cond:
                self._together -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._alone and not self._together)
            self._waiting -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()

    def turn(self, lease: Lease) -> contextlib.AbstractContextManager[None]:
        return self.alone() if retrying(shard_repo.may_kill_its_worker, lease.shard) else self.together()
