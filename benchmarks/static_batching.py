"""Static batching, the baseline continuous batching is measured against (generate_throughput.py):
a batch is admitted in the given order only when every slot is free, its finished rows keep being
computed, and its sequences are released together once all have finished.

    runtime.generate(requests, scheduler=StaticScheduler)
"""

from __future__ import annotations

from batchinf.runtime.generation.scheduler import Scheduler
from batchinf.runtime.generation.seq import GenRequest, Seq


class StaticScheduler(Scheduler):
    compacts = False

    @staticmethod
    def order(requests: list[GenRequest]) -> list[GenRequest]:
        return requests

    def admitting(self) -> bool:
        return not self.kv.occupied

    def update(self) -> list[Seq]:
        if any(s is not None and not s.done for s in self.kv.slots):
            return []
        return super().update()
