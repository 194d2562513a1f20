"""Planning is bounded: an input object whose planning task keeps failing, hangs or dies fails
the job after BATCHINF_MAX_ATTEMPTS attempts with the object named, instead of being planned
again forever. Attempts and the last error are columns of `job_inputs` (migration 0008)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from batchinf import failpoints, lifecycle
from batchinf.config import settings
from batchinf.controller import drive
from batchinf.dispatch import Dispatcher
from batchinf.ledger import db
from batchinf.ledger import jobs as job_repo
from batchinf.ledger.models import Job
from batchinf.manifest import parse_manifest
from batchinf.planning import pin_job, plan_one_object
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from tests.helpers.services import fresh_postgres_db as _fresh_postgres_db
from tests.helpers.corpus import manifest


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migration_0008_up_down_up(backend: str, tmp_path: Path) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else _fresh_postgres_db()
    sa_url = url if backend == "sqlite" else url.replace("postgresql://", "postgresql+psycopg://")

    def columns() -> set[str]:
        eng = create_engine(sa_url)
        try:
            return {c["name"] for c in inspect(eng).get_columns("job_inputs")}
        finally:
            eng.dispose()

    new = {"attempts", "started_at", "error"}
    assert db.upgrade(url, "0007") == "0007"
    assert not new & columns()
    assert db.upgrade(url, "0008") == "0008"
    assert new <= columns()
    command.downgrade(db.alembic_config(sa_url), "0007")
    assert not new & columns()
    assert db.upgrade(url, "0008") == "0008"
    assert new <= columns()


def _inputs(tmp_path: Path, n: int = 2) -> str:
    inp = tmp_path / "in"
    inp.mkdir()
    for k in range(n):
        (inp / f"o{k}.jsonl").write_text("".join(json.dumps({"id": f"o{k}-{i}", "text": f"text {i}"}) + "\n"
                                                 for i in range(5)))
    return str(inp) + "/"


def test_a_plan_task_that_keeps_failing_fails_the_job_naming_the_object(
        tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id, _ = submit(parse_manifest(manifest(_inputs(tmp_path, 1), str(tmp_path / "out"))), OPERATOR)
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "plan.object=raise")
    failpoints.reload()
    t0 = time.monotonic()
    try:
        assert drive(job_id, workers=1, threads=1) == "failed"
    finally:
        monkeypatch.delenv("BATCHINF_FAILPOINTS")
        failpoints.reload()
    assert time.monotonic() - t0 < 60
    job = job_repo.get(job_id)
    uri = job_repo.inputs(job_id)[0].pin.uri
    assert job.error.startswith(f"planning object {uri} failed 3 times: FailpointError"), job.error
    assert [o.attempts for o in job_repo.inputs(job_id)] == [settings().max_attempts]


class _Broker(Dispatcher):
    """A dispatcher whose messages go nowhere: the test plays the workers."""
    resends_lost = True
    requeue_seconds = 30.0

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[list[int]] = []

    def plan(self, job: Job, idxs: list[int]) -> None:
        self.sent.append(list(idxs))


def test_a_hung_or_dead_plan_task_counts_as_a_failed_attempt(
        tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id, _ = submit(parse_manifest(manifest(_inputs(tmp_path, 2), str(tmp_path / "out"))), OPERATOR)
    pin_job(job_repo.get(job_id))
    broker = _Broker()
    clock = [time.time()]
    monkeypatch.setattr(lifecycle, "now", lambda: clock[0])
    monkeypatch.setattr(job_repo, "now", lambda: clock[0])
    lifecycle._plan(job_repo.get(job_id), broker, None)
    assert broker.sent == [[0, 1]]
    assert plan_one_object(job_id, 1) == 5                  # object 1 plans fine
    for attempt in range(1, 4):                              # object 0's task hangs, three times
        assert job_repo.plan_attempt_started(job_id, 0)
        clock[0] += 100                                      # still within the time limit:
        lifecycle._plan(job_repo.get(job_id), broker, None)  # neither sent again nor failed
        assert len(broker.sent) == attempt and job_repo.get(job_id).status == "planning"
        clock[0] += settings().plan_time_limit + lifecycle.PLAN_GRACE_SECONDS
        lifecycle._plan(job_repo.get(job_id), broker, None)
        if attempt < 3:
            assert broker.sent[-1] == [0]                    # sent again; object 1 is done
    job = job_repo.get(job_id)
    assert job.status == "failed"
    assert job.error == (f"planning object {job_repo.inputs(job_id)[0].pin.uri} failed 3 times: its last attempt "
                         "ran past BATCHINF_PLAN_TIME_LIMIT (3600 s) or its worker died")
    assert not job_repo.plan_attempt_started(job_id, 1)      # a duplicate of a planned object does nothing


def test_a_recorded_error_is_retried_soon_and_then_named(
        tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id, _ = submit(parse_manifest(manifest(_inputs(tmp_path, 1), str(tmp_path / "out"))), OPERATOR)
    pin_job(job_repo.get(job_id))
    broker = _Broker()
    clock = [time.time()]
    monkeypatch.setattr(lifecycle, "now", lambda: clock[0])
    monkeypatch.setattr(job_repo, "now", lambda: clock[0])
    for attempt in range(1, 4):
        lifecycle._plan(job_repo.get(job_id), broker, None)
        assert len(broker.sent) == attempt
        assert job_repo.plan_attempt_started(job_id, 0)
        job_repo.plan_attempt_failed(job_id, 0, "RecursionError: maximum recursion depth exceeded")
        clock[0] += 2.0 ** attempt + 0.1                     # a failed attempt backs off briefly
    lifecycle._plan(job_repo.get(job_id), broker, None)
    job = job_repo.get(job_id)
    assert job.status == "failed" and len(broker.sent) == 3
    assert job.error.endswith("failed 3 times: RecursionError: maximum recursion depth exceeded")
