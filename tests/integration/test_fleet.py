"""Fleet behaviour in distributed mode with real processes: speculative attempts for stragglers,
and fair share between a large low-priority backfill and a small urgent job."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from batchinf.ledger.status import status
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.ledger.db import tx
from batchinf.ledger.tables import attempts, job_events, shards
from batchinf.manifest import parse_manifest
from batchinf.store import get_store
from tests.helpers.cluster import SLOW, Cluster, exactly_once, job, wait
from tests.helpers.corpus import manifest, write_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_straggler_gets_a_speculative_attempt_that_wins(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    """w1 stalls (alive, heartbeating) in the one shard it takes; w2 runs the rest, then a twin
    of the stalled shard. The twin commits first; w1's attempt is superseded, can never commit,
    and removes its files when it wakes."""
    job_id, good = job(tmp_path, s3_bucket, n=240, max_records=40)
    cluster.env.update({"BATCHINF_SPECULATE_MIN_SECONDS": "1", "BATCHINF_SPECULATE_FACTOR": "3"})
    cluster.controller()
    cluster.worker("w1", BATCHINF_FAILPOINTS="execute.before_write=sleep(20)")
    wait(job_id, cluster, until=lambda s: s["shards"]["running"] >= 1)
    t0 = time.monotonic()
    cluster.worker("w2")
    wait(job_id, cluster, timeout=60)
    exactly_once(job_id, s3_bucket, good)
    with tx() as conn:
        rows = conn.execute(select(attempts.c.shard_id, attempts.c.number, attempts.c.status, attempts.c.worker)
                            .order_by(attempts.c.shard_id, attempts.c.number)).all()
        spec = conn.execute(select(job_events.c.shard_id).where(job_events.c.kind == "attempt",
                                                                job_events.c.detail.contains('"speculative": true'))
                            ).scalars().all()
    assert len(spec) == 1
    (straggler,) = spec
    mine = {r.number: r for r in rows if r.shard_id == straggler}
    assert mine[1].status in ("superseded", "swept") and mine[2].status == "committed"
    assert mine[1].worker != mine[2].worker
    with tx() as conn:
        assert conn.execute(select(shards.c.attempt).where(shards.c.id == straggler)).scalar() == 2
    time.sleep(max(0.0, t0 + 22 - time.monotonic()))   # w1 wakes, writes, fails to commit, cleans up
    # how long the cleanup takes after the wake depends on the machine's load: awaited, with a deadline
    store = get_store(s3_bucket)
    left = store.list(f"{s3_bucket}/out/_work/")
    while left and time.monotonic() < t0 + 60:
        time.sleep(0.5)
        left = store.list(f"{s3_bucket}/out/_work/")
    assert not left, "the losing attempt left files behind"


def test_urgent_job_is_not_starved_by_a_backfill(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    """Dispatch order, not preemption: once the urgent job arrives, the backfill gets no new slot
    until the urgent job has none left to fill, so the urgent job finishes first."""
    backfill, _ = job(tmp_path, s3_bucket, n=600, max_records=20)        # ~30 shards, priority 0
    cluster.controller()
    cluster.worker("w1", **SLOW)
    wait(backfill, cluster, until=lambda s: s["shards"]["committed"] >= 2)
    write_jsonl(tmp_path / "urgent.jsonl", 60, seed=5)
    with tx() as conn:
        since = conn.execute(select(func.max(job_events.c.id))).scalar()
    urgent, _ = submit(parse_manifest(manifest(str(tmp_path / "urgent.jsonl"), f"{s3_bucket}/urgent/",
                                               shards={"max_records": 20}, priority=10)), OPERATOR)
    done = wait(urgent, cluster)
    assert done["status"] == "succeeded"
    assert status(backfill)["status"] == "running", "the backfill finished first: the urgent job was starved"
    with tx() as conn:
        commits = conn.execute(select(job_events.c.job_id).where(
            job_events.c.id > since, job_events.c.kind == "shard", job_events.c.to_status == "committed")
            .order_by(job_events.c.id)).scalars().all()
    last_urgent = max(i for i, j in enumerate(commits) if j == urgent)
    # the urgent job overtook the backfill: most of the backfill's shards were still to run
    total = status(backfill)["shards"]["total"]
    assert commits[:last_urgent].count(backfill) <= total // 2, (total, commits)
