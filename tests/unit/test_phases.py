"""Phases of a job's wall time (batchinf/phases.py): consecutive, non-negative, summing to the
wall time; worker start-up and model load hidden behind planning are not on the job's clock; each
worker's own account of its time."""

from __future__ import annotations

import time

import pytest

from batchinf.phases import PHASES, AttemptSpan, compute, process_started_at, view

C = 1000.0      # the job's creation


def marks(**at: float) -> dict:
    return {"process_started_at": C - 1.5, "at": at}


def total(ph: dict) -> float:
    return sum(ph[k] for k in PHASES if ph[k] is not None)


def test_phases_cut_the_wall_time_in_order() -> None:
    m = marks(planning=C + 0.1, running=C + 0.6, verifying=C + 4.0, succeeded=C + 4.3)
    m["workers"] = {"h:1": {"spawned_at": C + 0.05, "ready_at": C + 1.0, "loaded_at": C + 2.0}}
    ph = compute(m, C, now=C + 4.3, attempts=[AttemptSpan("h:1", C + 2.1, C + 3.9, 0.9)])
    assert {k: ph[k] for k in ("wall", *PHASES)} == {
        "wall": 5.8, "startup": 1.5, "pin": 0.1, "plan": 0.5, "pool_start": 0.4, "model_load": 1.0,
        "execute": 2.0, "publish": 0.3}
    assert total(ph) == pytest.approx(ph["wall"])
    # up 3.95 s (spawned -> verifying): 0.95 starting, 1.0 loading (the driver's report wins), 1.8 busy
    assert ph["workers"] == [{"worker": "h:1", "start": 0.95, "model_load": 1.0, "busy": 1.8, "idle": 0.2,
                              "shards": 1}]


def test_start_and_load_hidden_behind_planning_cost_the_job_nothing() -> None:
    m = marks(planning=C + 0.1, running=C + 5.0, verifying=C + 6.0)
    m["workers"] = {"h:1": {"spawned_at": C, "ready_at": C + 1.0, "loaded_at": C + 3.0},
                    "h:2": {"spawned_at": C, "ready_at": C + 1.2, "loaded_at": C + 3.5}}
    ph = compute(m, C, now=C + 6.5, attempts=[AttemptSpan("h:1", C + 5.1, C + 5.9)])
    assert ph["pool_start"] == ph["model_load"] == 0.0
    assert ph["execute"] == 1.0 and ph["publish"] == 0.5
    assert total(ph) == pytest.approx(ph["wall"])
    idle = {w["worker"]: (w["busy"], w["idle"], w["shards"]) for w in ph["workers"]}
    assert idle == {"h:1": (0.8, 2.2, 1), "h:2": (0.0, 2.5, 0)}     # h:2 loaded, never ran a shard


def test_a_worker_still_loading_when_the_job_ended_is_listed_up_and_idle() -> None:
    """The pool names each worker from its spawn (WorkerPool.worker_reports): one that had not
    reported ready when a small job ended is listed, never ready, idle all the time it was up."""
    m = marks(planning=C + 0.1, running=C + 0.6, verifying=C + 2.0)
    m["workers"] = {"h:1": {"spawned_at": C + 0.05, "ready_at": C + 0.5, "loaded_at": C + 1.0},
                    "h:2": {"spawned_at": C + 0.05}}
    ph = compute(m, C, now=C + 2.1, attempts=[AttemptSpan("h:1", C + 1.1, C + 1.9)])
    late = next(w for w in ph["workers"] if w["worker"] == "h:2")
    assert late == {"worker": "h:2", "start": None, "model_load": None, "busy": 0.0, "idle": 1.95, "shards": 0}


def test_without_reports_the_first_attempt_says_when_a_worker_was_ready() -> None:
    """A Celery worker reports to no driver: the first attempt's start ends the wait for a worker,
    the load it paid (on its attempt row) is model load; workers count from the execute phase."""
    m = {"at": {"planning": C + 1.0, "running": C + 2.0, "verifying": C + 9.0}}
    spans = [AttemptSpan("a:1", C + 3.0, C + 8.0, 2.0), AttemptSpan("b:1", C + 3.5, C + 9.0, None)]
    ph = compute(m, C, now=C + 10.0, attempts=spans)
    assert ph["startup"] is None and ph["wall"] == 10.0        # from the job's creation
    assert (ph["pool_start"], ph["model_load"], ph["execute"]) == (1.0, 2.0, 4.0)
    assert total(ph) == pytest.approx(ph["wall"])
    assert ph["workers"] == [
        {"worker": "a:1", "start": None, "model_load": 2.0, "busy": 5.0, "idle": 0.0, "shards": 1},
        {"worker": "b:1", "start": None, "model_load": 0.0, "busy": 5.5, "idle": 1.5, "shards": 1}]


def test_now_ends_the_phase_in_progress() -> None:
    ph = compute(marks(planning=C + 0.2, running=C + 1.0), C, now=C + 3.0)
    assert (ph["pin"], ph["plan"], ph["execute"], ph["publish"]) == (0.2, 0.8, 2.0, None)
    assert ph["pool_start"] is None and ph["model_load"] is None and ph["workers"] == []
    planning = compute(marks(planning=C + 0.2), C, now=C + 3.0)
    assert (planning["plan"], planning["execute"]) == (2.8, None)
    submitted = compute({}, C, now=C + 0.5)
    assert (submitted["wall"], submitted["pin"], submitted["plan"]) == (0.5, 0.5, None)


def test_a_running_job_shows_the_phases_that_ended() -> None:
    """Without `now` (a status read of a running job) the phase in progress and the wall are None:
    two reads of an unchanged job agree; workers show their start and load, not yet busy or idle."""
    m = marks(planning=C + 0.2, running=C + 1.0)
    m["workers"] = {"h:1": {"spawned_at": C, "ready_at": C + 1.5, "loaded_at": C + 2.5}}
    ph = compute(m, C, now=None)
    assert {k: ph[k] for k in ("wall", *PHASES)} == {
        "wall": None, "startup": 1.5, "pin": 0.2, "plan": 0.8, "pool_start": 0.5, "model_load": 1.0,
        "execute": None, "publish": None}
    assert ph["workers"] == [{"worker": "h:1", "start": 1.5, "model_load": 1.0, "busy": None, "idle": None,
                              "shards": None}]
    assert compute(m, C, now=None) == ph
    planning = compute(marks(planning=C + 0.2), C, now=None)
    assert (planning["pin"], planning["plan"], planning["pool_start"]) == (0.2, None, None)


def test_marks_out_of_order_never_give_negative_phases() -> None:
    """Clocks of several machines disagree a little: a worker ready 'before' the job planned, a
    transition stamped before the previous one: every phase is clamped to its neighbours."""
    m = marks(planning=C - 0.3, running=C + 0.2, verifying=C + 0.1)
    m["workers"] = {"h:1": {"spawned_at": C - 5, "ready_at": C + 9.0, "loaded_at": C + 8.0}}
    ph = compute(m, C, now=C + 1.0, attempts=[])
    assert all(ph[k] is not None and ph[k] >= 0 for k in PHASES)
    assert total(ph) <= ph["wall"] + 1e-9


def test_status_shows_the_phases_kept_when_the_job_ended() -> None:
    final = {"wall": 1.0, "workers": []}
    assert view('{"final": {"wall": 1.0, "workers": []}, "at": {}}', C, C + 5.0) == final
    assert view(None, C, C + 2.0)["wall"] == 2.0       # ended without them: up to its end
    assert view(None, C, None)["wall"] is None          # still running


def test_process_start_is_before_now() -> None:
    started = process_started_at()
    assert started is not None and 0 <= time.time() - started < 24 * 3600
