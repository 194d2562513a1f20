"""The heartbeat of a leased attempt: a thread started the moment the worker holds the lease
(`dispatch.run_shard`, `dispatch.worker_main`), before the worker imports its runtime or loads
the bundle, so a slow download or model load never looks like a dead worker. This module imports
only the ledger: starting it costs no heavy import."""

from __future__ import annotations

import os
import threading
from typing import Callable

from batchinf.config import settings
from batchinf.ledger import leases, splits
from batchinf.ledger.models import Lease


class Heartbeat(threading.Thread):
    """Extends the lease while the attempt runs; flags `lost` when the fencing token is gone.
    `on_nearly_done` is called once the attempt starts its shard's last chunk (`nearly_done`)."""

    def __init__(self, lease: Lease, parent_pid: int | None = None,
                 on_nearly_done: Callable[[], None] | None = None) -> None:
        super().__init__(daemon=True)
        self.lease, self.parent_pid, self.on_nearly_done = lease, parent_pid, on_nearly_done
        self.lost = threading.Event()
        self.records_done = 0       # records of the shard finished so far, sent with each heartbeat
        self.progress_done: int | None = None   # the attempt's progress units so far (Task.progress_unit), if counted
        self._stop = threading.Event()

    def nearly_done(self, least: int, soon: int) -> None:
        """The attempt starts its shard's last chunk: report its progress now rather than at the
        next beat, and ask for a running shard of the job to split for this worker meanwhile
        (`splits.request_split`, with the job's `sizing.split_bounds`), then call
        `on_nearly_done`; the driver also counts this worker as about to idle from then on."""
        try:
            leases.heartbeat(self.lease, settings().lease_seconds, self.records_done, self.progress_done)
            splits.request_split(self.lease.job_id, None, least, soon_work=soon)
        except Exception:  # noqa: BLE001 -- only the split comes later: the driver asks when idle
            pass
        if self.on_nearly_done is not None:
            self.on_nearly_done()

    def run(self) -> None:
        s = settings()
        while not self._stop.wait(s.heartbeat_seconds):
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                os._exit(1)  # embedded driver died: do not outlive it
            try:
                if not leases.heartbeat(self.lease, s.lease_seconds, self.records_done, self.progress_done):
                    self.lost.set()
                    return
            except Exception:  # noqa: BLE001 -- a missed heartbeat is retried on the next tick
                continue

    def stop(self) -> None:
        self._stop.set()
