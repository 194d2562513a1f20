"""Lanes: a worker process that runs several shards at once, a thread each, sharing the bundle it
loaded (dispatch.worker_main), and the layout a one-job pool picks (lanes.local_layout): a
generate job on the CPU runs as one process with a lane per core."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from batchinf import controller, lanes
from batchinf.config import settings
from batchinf.ledger.db import tx
from batchinf.ledger.states import JobStatus
from batchinf.ledger.tables import attempts
from batchinf.ledger.tables import shards as shard_table
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.env import OPERATOR


def _job(task: str, engine: str = "native", device: str = "any") -> SimpleNamespace:
    return SimpleNamespace(task=task, engine=engine, device=device)


@pytest.mark.parametrize("cores", [1, 2, 8])
def test_the_default_layout_is_a_lane_per_core_for_generation_on_the_cpu(cores: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lanes, "usable_cores", lambda: cores)
    monkeypatch.setattr(lanes, "cuda_possible", lambda: False)
    assert lanes.local_layout(_job("generate")) == (1, cores, 1)
    assert lanes.local_layout(_job("generate"), "cpu") == (1, cores, 1)
    for other in (_job("embed"), _job("transcribe"), _job("generate", engine="vllm"),
                  _job("generate", device="cuda")):
        assert lanes.local_layout(other) == (cores, 1, 1)
    assert lanes.local_layout(_job("generate"), "cuda") == (cores, 1, 1)
    # what is given is kept; the rest fills the cores
    assert lanes.local_layout(_job("generate"), workers=2) == (2, 1, max(1, cores // 2))
    assert lanes.local_layout(_job("generate"), workers=1, threads=cores) == (1, 1, cores)
    assert lanes.local_layout(_job("embed"), lanes=2) == (max(1, cores // 2), 2, 1 if cores >= 2 else 1)
    assert lanes.local_layout(_job("embed"), threads=2) == (max(1, cores // 2), 1, 2)


def test_one_worker_runs_two_shards_at_once_on_its_lanes(tmp_path: Path, tiny_bundle: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    write_jsonl(tmp_path / "in" / "part-0.jsonl", 48, bad=False)
    raw = manifest(str(tmp_path / "in") + "/", str(tmp_path / "out"), shards={"max_records": 12})
    job_id, _ = submit(parse_manifest(raw), OPERATOR)
    # each attempt holds its lane a while, so two lanes overlap if they run at once
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.load=sleep(1.0)")
    settings.cache_clear()
    assert controller.drive(job_id, workers=1, lanes=2, device="cpu", threads=1) == JobStatus.SUCCEEDED
    with tx() as conn:
        rows = conn.execute(select(attempts.c.worker, attempts.c.started_at, attempts.c.finished_at).join(
            shard_table, shard_table.c.id == attempts.c.shard_id).where(shard_table.c.job_id == job_id)).all()
    assert len(rows) >= 4       # its 4 shards (a split adds one)
    assert len({r.worker for r in rows}) == 1, "one worker process"
    spans = sorted((r.started_at, r.finished_at) for r in rows)
    most = max(sum(1 for s, f in spans if s <= t < f) for t, _ in spans)
    assert most == 2, f"at most two attempts at once, and two did overlap: {spans}"


def test_the_lanes_of_a_process_share_a_generate_jobs_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.runtime import threads

    assert threads.lane_share(64) == 64
    monkeypatch.setattr(threads, "_lanes", 2)
    assert threads.lane_share(64) == 32 and threads.lane_share(1) == 1
    monkeypatch.setattr(threads, "_lanes", 3)
    assert threads.lane_share(64) == 21


def test_a_shard_that_may_kill_its_worker_runs_alone_on_its_lanes() -> None:
    """LaneGate: a shard to run alone waits for the shards running together, and none starts
    beside it while it waits or runs."""
    import threading
    import time

    gate = lanes.LaneGate()
    log: list[str] = []
    first_in = threading.Event()

    def together(name: str, hold: float) -> None:
        with gate.together():
            log.append(f"{name}+")
            first_in.set()
            time.sleep(hold)
            log.append(f"{name}-")

    def alone() -> None:
        with gate.alone():
            log.append("alone+")
            time.sleep(0.1)
            log.append("alone-")

    a = threading.Thread(target=together, args=("a", 0.3))
    a.start()
    first_in.wait()
    s = threading.Thread(target=alone)
    s.start()
    time.sleep(0.05)                  # the lone shard now waits for `a`
    b = threading.Thread(target=together, args=("b", 0.0))
    b.start()                         # ... and `b` waits for it
    for t in (a, s, b):
        t.join()
    assert log == ["a+", "a-", "alone+", "alone-", "b+", "b-"]
