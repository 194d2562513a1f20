"""Migration 0010 (jobs.retry_of, retry_records) up, down and up again on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from batchinf.ledger import db
from tests.helpers.services import fresh_postgres_db as _fresh_postgres_db

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migration_0010_up_down_up(backend: str, tmp_path: Path) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else _fresh_postgres_db()
    assert db.upgrade(url, "0009") == "0009"
    sa_url = url if backend == "sqlite" else url.replace("postgresql://", "postgresql+psycopg://")

    def schema() -> set[str]:
        eng = create_engine(sa_url)
        try:
            insp = inspect(eng)
            names = set(insp.get_table_names())
            names |= {f"jobs.{c['name']}" for c in insp.get_columns("jobs")}
            names |= {f"index {i['name']}" for i in insp.get_indexes("jobs")}
        finally:
            eng.dispose()
        return names

    added = {"retry_records", "jobs.retry_of", "index ix_jobs_retry_of"}
    assert not added & schema()
    assert db.upgrade(url, "0010") == "0010"
    assert added <= schema()
    command.downgrade(db.alembic_config(sa_url), "0009")
    assert not added & schema()
    assert db.upgrade(url, "0010") == "0010"
    assert added <= schema()
