"""The ledger's state tables themselves (no database)."""

from __future__ import annotations

from batchinf.ledger.states import (
    ATTEMPT_LOSERS,
    ATTEMPT_TRANSITIONS,
    JOB_ACTIVE,
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    SHARD_TERMINAL,
    SHARD_TRANSITIONS,
    AttemptStatus,
    JobStatus,
    ShardStatus,
)


def test_state_groups_cover_the_enums() -> None:
    assert set(JOB_TRANSITIONS) == set(JobStatus)
    assert set(SHARD_TRANSITIONS) == set(ShardStatus)
    assert set(ATTEMPT_TRANSITIONS) == set(AttemptStatus)
    assert all(AttemptStatus.SWEPT in ATTEMPT_TRANSITIONS[s] for s in ATTEMPT_LOSERS)
    assert not ATTEMPT_TRANSITIONS[AttemptStatus.COMMITTED]      # a winner never changes outcome
    assert JOB_ACTIVE | JOB_TERMINAL == set(JobStatus) and not JOB_ACTIVE & JOB_TERMINAL
    assert all(not JOB_TRANSITIONS[s] for s in JOB_TERMINAL)
    assert all(not SHARD_TRANSITIONS[s] for s in SHARD_TERMINAL)
    for s in JOB_ACTIVE:   # any non-final state can fail, be cancelled or expire
        assert {JobStatus.FAILED, JobStatus.EXPIRED} <= JOB_TRANSITIONS[s]
        assert s is JobStatus.CANCELLING or JobStatus.CANCELLING in JOB_TRANSITIONS[s]
