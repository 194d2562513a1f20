"""Migration 0009 (shards.progress_records, the records a running shard's heartbeats report done)
up, down and up again on SQLite and PostgreSQL, and the heartbeat that fills it."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from batchinf.ledger import db
from batchinf.retry_policy import RetryPolicy
from tests.helpers.env import OPERATOR
from tests.helpers.services import fresh_postgres_db as _fresh_postgres_db

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migration_0009_up_down_up(backend: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else _fresh_postgres_db()
    sa_url = url if backend == "sqlite" else url.replace("postgresql://", "postgresql+psycopg://")

    def columns() -> set[str]:
        eng = create_engine(sa_url)
        try:
            return {c["name"] for c in inspect(eng).get_columns("shards")}
        finally:
            eng.dispose()

    assert db.upgrade(url, "0008") == "0008"
    assert "progress_records" not in columns()
    assert db.upgrade(url, "0009") == "0009"
    assert "progress_records" in columns()
    assert db.state(url)["current"] == "0009"
    assert db.downgrade("0008", url) == "0008"
    assert "progress_records" not in columns()
    assert db.state(url)["up_to_date"] is False
    assert db.upgrade(url, "0009") == "0009"
    assert "progress_records" in columns()


def test_heartbeat_progress_counts_before_the_shard_commits(tmp_path: Path, tiny_bundle: str) -> None:
    """A running shard's heartbeats carry its records done; the status counts them (a generate job
    no longer shows 0 records and no ETA until its first shard commits). A new attempt starts at 0."""
    from batchinf.ledger import leases, shards
    from batchinf.ledger.status import status
    from batchinf.manifest import parse_manifest
    from batchinf.submit import submit
    from tests.helpers.corpus import manifest, write_jsonl
    from tests.helpers.stages import plan_job

    write_jsonl(tmp_path / "in.jsonl", 60, seed=4, bad=False)
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in.jsonl"), str(tmp_path / "out"))), OPERATOR)
    plan_job(job_id)
    shards.dispatch_ready(job_id)
    lease = leases.claim_next([job_id], "test:1", 30)
    assert lease is not None
    assert status(job_id)["counts"]["records_done"] == 0
    assert leases.heartbeat(lease, 30, progress_records=17)
    s = status(job_id)
    assert s["counts"]["records_done"] == 17 and s["counts"]["records_succeeded"] == 0
    assert s["progress"]["records_per_second"] and s["progress"]["eta_seconds"] is not None
    three = RetryPolicy.from_settings(max_attempts=3)
    assert leases.expire_leases(job_id, three, dead_owners=["test:1"]) == 1     # its worker died
    assert status(job_id)["counts"]["records_done"] == 0                   # a retrying shard's progress is not counted
