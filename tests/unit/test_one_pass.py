"""One pass per job: a lifecycle step reads its job once and passes the `Job` down; a claim
returns the shard and its job, so a worker reads neither again; idle workers sleep until woken.
Counted on a real 6-shard embedded job: the driver and its spawned worker processes each record
every job row they read (`Job.from_row`) and every statement (tests/helpers/reads.py)."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import func, select

from batchinf import controller, dispatch
from batchinf.ledger import shards
from batchinf.ledger.db import tx
from batchinf.ledger.states import JobStatus
from batchinf.ledger.status import status
from batchinf.ledger.tables import attempts
from batchinf.ledger.tables import shards as shard_table
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from tests.helpers import reads
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.env import OPERATOR

# Before this change the same job read its row about 3 times per step (`step` read it, read it
# again after it, and `drive` once more), and each idle worker once per 100 ms poll; status() took
# 5 SELECTs.


def _six_shard_job(tmp_path: Path) -> str:
    write_jsonl(tmp_path / "in" / "part-0.jsonl", 60, bad=False)      # one object: one planning task
    raw = manifest(str(tmp_path / "in") + "/", str(tmp_path / "out"), shards={"max_records": 12})
    job_id, created = submit(parse_manifest(raw), OPERATOR)
    assert created
    return job_id


def test_a_six_shard_job_reads_its_row_once_per_step_and_per_task(
        tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = _six_shard_job(tmp_path)
    log = tmp_path / "reads"
    log.mkdir()
    monkeypatch.setattr(dispatch, "worker_main", functools.partial(reads.counted, str(log), "batchinf.dispatch:worker_main"))
    steps = []
    advance = controller.advance
    monkeypatch.setattr(controller, "advance", lambda job, *a, **k: steps.append(job.status) or advance(job, *a, **k))
    stop = reads.install(log)
    try:
        # stepped only when a worker reports (an attempt ends, a worker idles), never by the clock,
        # so the count does not depend on how long the workers take to start
        assert controller.drive(job_id, workers=2, device="cpu", threads=1, tick=60) == JobStatus.SUCCEEDED
    finally:
        stop()
    assert len(shards.of_job(job_id)) == 6
    with tx() as conn:
        tasks = conn.execute(select(func.count()).select_from(attempts).join(
            shard_table, shard_table.c.id == attempts.c.shard_id).where(shard_table.c.job_id == job_id)).scalar()
    by_process = {f.stem: Counter(f.read_text().split()) for f in log.glob("*.log")}
    driver = by_process.pop(str(os.getpid()))
    workers = sum(by_process.values(), Counter())
    rows = driver["job_row"] + workers["job_row"]
    print(f"steps {len(steps)}, attempts {tasks}: job rows read {rows} (driver {driver['job_row']}, workers "
          f"{workers['job_row']}); statements {sum(driver.values()) + sum(workers.values())}; steps by status "
          f"{dict(Counter(steps))}")
    # the bound: one read per lifecycle step (the driver's first read serves its first step; the
    # planning task runs inside a step, on the step's Job) and one per shard task (its claim)
    assert driver["job_row"] <= len(steps)
    assert workers["job_row"] <= tasks          # an idle worker never reads the job
    assert rows <= len(steps) + tasks
    assert rows < 29        # before: about 3 reads a step (here 14 steps) and one per idle poll of each worker


def test_status_is_two_selects(tmp_path: Path, tiny_bundle: str) -> None:
    job_id = _six_shard_job(tmp_path)
    log = tmp_path / "reads"
    log.mkdir()
    stop = reads.install(log)
    try:
        s = status(job_id)
    finally:
        stop()
    assert s["job_id"] == job_id and s["status"] == JobStatus.SUBMITTED and s["retries"] == []
    counted = reads.totals(log)
    assert counted["select_jobs"] + counted["select"] == 2          # was 5


def test_an_idle_worker_sleeps_until_woken() -> None:
    work = dispatch.WorkSignal(mp.get_context("spawn"))
    seen = work.seen()
    t = time.monotonic()
    work.wait(seen, timeout=0.3)                  # nothing new: it sleeps the whole timeout
    assert time.monotonic() - t >= 0.25
    work.notify()                                 # a wake between its look and its wait is not lost
    t = time.monotonic()
    work.wait(seen, timeout=5)
    assert time.monotonic() - t < 1
    seen = work.seen()
    work.close()
    t = time.monotonic()
    work.wait(seen, timeout=5)
    assert time.monotonic() - t < 1 and work.closed()


def _sleep_on(work: dispatch.WorkSignal, wake: dispatch.Wake, ready: "mp.synchronize.Event") -> None:
    ready.set()
    while True:                                   # an idle worker: wakes the driver, sleeps, looks again
        wake.set()
        work.wait(work.seen(), timeout=0.05)


def test_workers_killed_while_they_wait_or_ask_never_hang_their_driver() -> None:
    """SIGKILL workers while they sleep on the work signal and set the driver's wake, many times
    over: the driver's notify, wait and close still return at once (a shared Condition's notify
    waited forever for a killed sleeper, and `batchinf run` hung after printing its result)."""
    ctx = mp.get_context("spawn")
    work, wake = dispatch.WorkSignal(ctx), dispatch.Wake(ctx)
    for _ in range(4):
        ready = [ctx.Event() for _ in range(3)]
        procs = [ctx.Process(target=_sleep_on, args=(work, wake, r), daemon=True) for r in ready]
        for p in procs:
            p.start()
        for r in ready:
            assert r.wait(60)
        for p in procs:
            os.kill(p.pid, 9)
        for p in procs:
            p.join(10)
        t = time.monotonic()
        for _ in range(1000):
            work.notify()
        wake.wait(0.01)
        assert time.monotonic() - t < 2
    assert wake.wait(0.05) is False               # a wake is cleared by the wait that saw it
    work.close()
    assert work.closed()
