"""Fair share of dispatch slots between concurrent jobs (controller.share_slots)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batchinf.lifecycle import share_slots
from batchinf.ledger.models import Demand


def _d(job: str, priority: int = 0, in_flight: int = 0, ready: int = 0, deadline: float | None = None,
       created: float = 0.0) -> Demand:
    return Demand(job, priority, deadline, created, in_flight, ready)


def test_an_urgent_job_takes_every_free_slot_before_a_backfill() -> None:
    backfill = _d("backfill", priority=0, in_flight=6, ready=10_000, created=1)
    urgent = _d("urgent", priority=10, in_flight=0, ready=3, created=2)
    assert share_slots(8, [backfill, urgent]) == {"backfill": 0, "urgent": 2}
    assert share_slots(16, [backfill, urgent]) == {"backfill": 7, "urgent": 3}


def test_earlier_deadline_first_then_round_robin_between_equals() -> None:
    a = _d("a", ready=5, created=1)
    b = _d("b", ready=5, created=2)
    late = _d("late", ready=5, deadline=200.0)
    soon = _d("soon", ready=2, deadline=100.0)
    assert share_slots(7, [a, b, late, soon]) == {"soon": 2, "late": 5, "a": 0, "b": 0}
    assert share_slots(5, [a, b]) == {"a": 3, "b": 2}


def test_nothing_is_dispatched_past_the_fleet_limit() -> None:
    assert share_slots(4, [_d("a", in_flight=4, ready=9), _d("b", priority=9, ready=9)]) == {"a": 0, "b": 0}


@given(st.integers(0, 64), st.lists(st.tuples(st.integers(-2, 2), st.integers(0, 8), st.integers(0, 20)),
                                    max_size=6))
def test_shares_respect_the_limit_and_the_demand(limit: int, specs: list[tuple[int, int, int]]) -> None:
    demand = [_d(f"j{i}", p, f, r, created=i) for i, (p, f, r) in enumerate(specs)]
    shares = share_slots(limit, demand)
    in_flight = sum(d.in_flight for d in demand)
    assert sum(shares.values()) == min(max(0, limit - in_flight), sum(d.ready for d in demand))
    assert all(0 <= shares[d.job_id] <= d.ready for d in demand)
    for hi in demand:          # a job gets a slot only when every higher-priority job is satisfied
        for lo in demand:
            if lo.priority < hi.priority and shares[lo.job_id]:
                assert shares[hi.job_id] == hi.ready


def test_a_job_still_planning_keeps_the_slots_it_outranks_free() -> None:
    from batchinf.ledger.shards import UNPLANNED_DEMAND

    backfill = _d("backfill", in_flight=2, ready=100)
    planning = _d("urgent", priority=5, ready=UNPLANNED_DEMAND)
    assert share_slots(6, [backfill, planning]) == {"backfill": 0, "urgent": 4}


def test_in_flight_is_bounded_by_the_fleet_on_the_queue(monkeypatch) -> None:  # noqa: ANN001
    """The broker holds the running shards plus a few about to be taken, never `max_in_flight`
    shards for a small fleet."""
    from batchinf.config import settings
    from batchinf.lifecycle import in_flight_cap

    monkeypatch.delenv("BATCHINF_DISPATCH_AHEAD", raising=False)
    settings.cache_clear()
    assert in_flight_cap(16, 2) == 4            # 2 processes + 2 ahead
    assert in_flight_cap(16, None) == 2         # a cold fleet: the margin alone
    assert in_flight_cap(100, 40) == 50         # a quarter of a large fleet ahead
    assert in_flight_cap(16, 40) == 16          # never above max_in_flight
    monkeypatch.setenv("BATCHINF_DISPATCH_AHEAD", "0")
    settings.cache_clear()
    assert in_flight_cap(16, 2) == 3 and in_flight_cap(16, None) == 1   # a quarter, rounded up
    settings.cache_clear()
