"""Job and shard state machines as tables of allowed edges.

Every transition goes through `ledger.jobs.transition` / `ledger.shards.transition`, which enforce
these tables (and `JOB_REOPENINGS`, an operator's way out of a final state) with
`UPDATE ... WHERE status IN (allowed sources)` and write one `job_events` row.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Iterable


class JobStatus(StrEnum):
    SUBMITTED = "submitted"    # manifest accepted, bundle digest resolved, inputs not yet pinned
    PLANNING = "planning"      # inputs pinned; records being read, tokenized and sharded
    PLANNED = "planned"        # shards cut by a dry run (`batchinf plan`); held until started
    RUNNING = "running"        # shards exist; workers are executing them
    VERIFYING = "verifying"    # every shard committed; coverage and digests being checked
    SUCCEEDED = "succeeded"    # _MANIFEST.json and _SUCCESS written
    FAILED = "failed"          # gave up; the reason is in jobs.error
    CANCELLING = "cancelling"  # cancel requested; running attempts are being stopped
    CANCELLED = "cancelled"    # stopped by request; _PARTIAL.json describes what is done
    EXPIRED = "expired"        # deadline passed before completion


class ShardStatus(StrEnum):
    PENDING = "pending"          # planned, not yet handed to a worker pool
    QUEUED = "queued"            # dispatched; any worker may claim it
    RUNNING = "running"          # leased by one attempt (fencing token = shards.attempt)
    RETRYING = "retrying"        # last attempt failed or its lease expired; waiting for backoff
    COMMITTED = "committed"      # exactly one winning attempt; its outputs are in the ledger
    QUARANTINED = "quarantined"  # its records killed every attempt's worker: split in halves into
                                 # child shards, or, holding one record, kept as a `poison` error row
    FAILED = "failed"            # attempts exhausted without a commit; fails the job


class AttemptStatus(StrEnum):
    RUNNING = "running"          # holds the shard (the fencing token) or runs beside it speculatively
    COMMITTED = "committed"      # the winner: its files are the shard's outputs
    FAILED = "failed"            # raised; counts against the shard's and the job's retry budgets
    LOST = "lost"                # its worker died or stalled past the lease
    RELEASED = "released"        # gave its lease back (Ctrl-C, a stopped driver, a cancel before it
                                 # finished anything): counts against no budget, its shard runs again at once
    SUPERSEDED = "superseded"    # another attempt of the same shard committed first
    SWEPT = "swept"              # a losing attempt whose files were deleted


ATTEMPT_TRANSITIONS: dict[AttemptStatus, set[AttemptStatus]] = {
    AttemptStatus.RUNNING: {AttemptStatus.COMMITTED, AttemptStatus.FAILED, AttemptStatus.LOST,
                            AttemptStatus.RELEASED, AttemptStatus.SUPERSEDED},
    AttemptStatus.FAILED: {AttemptStatus.SWEPT},
    AttemptStatus.LOST: {AttemptStatus.SWEPT},
    AttemptStatus.RELEASED: {AttemptStatus.SWEPT},
    AttemptStatus.SUPERSEDED: {AttemptStatus.SWEPT},
    AttemptStatus.COMMITTED: set(),
    AttemptStatus.SWEPT: set(),
}
ATTEMPT_LOSERS = frozenset({AttemptStatus.FAILED, AttemptStatus.LOST, AttemptStatus.RELEASED,
                            AttemptStatus.SUPERSEDED})


# Any non-final state may also fail or expire; any but cancelling may be cancelled.
_STOPS = {JobStatus.FAILED, JobStatus.EXPIRED}
JOB_TRANSITIONS: dict[JobStatus, set[JobStatus]] = {
    JobStatus.SUBMITTED: {JobStatus.PLANNING, JobStatus.CANCELLING, *_STOPS},
    JobStatus.PLANNING: {JobStatus.RUNNING, JobStatus.PLANNED, JobStatus.CANCELLING, *_STOPS},
    JobStatus.PLANNED: {JobStatus.RUNNING, JobStatus.CANCELLING, *_STOPS},
    JobStatus.RUNNING: {JobStatus.VERIFYING, JobStatus.CANCELLING, *_STOPS},
    JobStatus.VERIFYING: {JobStatus.SUCCEEDED, JobStatus.CANCELLING, *_STOPS},
    JobStatus.CANCELLING: {JobStatus.CANCELLED, *_STOPS},
    JobStatus.SUCCEEDED: set(),
    JobStatus.FAILED: set(),
    JobStatus.CANCELLED: set(),
    JobStatus.EXPIRED: set(),
}

# Edges out of a final state, taken by an operator's command only (never by the lifecycle, so
# `job_sources` leaves them out): failed -> verifying is `batchinf verify --publish`
# (`ledger.jobs.reopen_for_publish`), for a job that failed in verification with every shard done.
JOB_REOPENINGS: dict[JobStatus, set[JobStatus]] = {
    JobStatus.FAILED: {JobStatus.VERIFYING},
}

JOB_TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED})
JOB_ACTIVE = frozenset(JobStatus) - JOB_TERMINAL
JOB_PLANNING = frozenset({JobStatus.SUBMITTED, JobStatus.PLANNING})   # no shards yet

SHARD_TRANSITIONS: dict[ShardStatus, set[ShardStatus]] = {
    ShardStatus.PENDING: {ShardStatus.QUEUED},
    ShardStatus.QUEUED: {ShardStatus.RUNNING},
    ShardStatus.RUNNING: {ShardStatus.COMMITTED, ShardStatus.RETRYING, ShardStatus.FAILED,
                          ShardStatus.QUARANTINED},
    ShardStatus.RETRYING: {ShardStatus.QUEUED, ShardStatus.FAILED, ShardStatus.QUARANTINED},
    ShardStatus.COMMITTED: set(),
    ShardStatus.QUARANTINED: set(),
    ShardStatus.FAILED: set(),
}

SHARD_TERMINAL = frozenset({ShardStatus.COMMITTED, ShardStatus.QUARANTINED, ShardStatus.FAILED})
SHARD_DONE = frozenset({ShardStatus.COMMITTED, ShardStatus.QUARANTINED})  # count toward coverage
SHARD_WAITING = frozenset({ShardStatus.PENDING, ShardStatus.QUEUED, ShardStatus.RETRYING})  # for a worker
SHARD_IN_FLIGHT = frozenset({ShardStatus.QUEUED, ShardStatus.RUNNING})   # holding a dispatch slot


def values(group: Iterable[StrEnum]) -> list[str]:
    """The string values of a status group, for SQL `IN (...)`."""
    return sorted(s.value for s in group)


def job_sources(target: JobStatus, *, reopen: bool = False) -> set[str]:
    """States from which `target` may be entered; with `reopen`, by a `JOB_REOPENINGS` edge too."""
    table = [JOB_TRANSITIONS, JOB_REOPENINGS] if reopen else [JOB_TRANSITIONS]
    return {s.value for t in table for s, targets in t.items() if target in targets}


def shard_sources(target: ShardStatus) -> set[str]:
    return {s.value for s, targets in SHARD_TRANSITIONS.items() if target in targets}


def attempt_sources(target: AttemptStatus) -> set[str]:
    return {s.value for s, targets in ATTEMPT_TRANSITIONS.items() if target in targets}
