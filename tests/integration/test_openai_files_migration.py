"""Migration 0007 (OpenAI files and batches) up, down and up again on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from batchinf.ledger import db
from tests.helpers.services import fresh_postgres_db as _fresh_postgres_db

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migration_0007_up_down_up(backend: str, tmp_path: Path) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else _fresh_postgres_db()
    sa_url = url if backend == "sqlite" else url.replace("postgresql://", "postgresql+psycopg://")

    def tables() -> set[str]:
        eng = create_engine(sa_url)
        try:
            return set(inspect(eng).get_table_names())
        finally:
            eng.dispose()

    assert db.upgrade(url, "0006") == "0006"
    assert not {"files", "batches"} & tables()
    assert db.upgrade(url, "0007") == "0007"
    assert {"files", "batches"} <= tables()
    command.downgrade(db.alembic_config(sa_url), "0006")
    assert not {"files", "batches"} & tables()
    assert db.upgrade(url, "0007") == "0007"
