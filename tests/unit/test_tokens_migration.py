"""Migration 0004 (API tokens, schedule runs) on SQLite and PostgreSQL, and hashed tokens."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, select

from batchinf import tenants
from batchinf.errors import LedgerError
from batchinf.ledger import db
from batchinf.ledger.db import tx
from batchinf.ledger.tables import api_tokens
from tests.helpers.services import fresh_postgres_db


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_migration_0004_up_down_up(backend: str, tmp_path: Path) -> None:
    from alembic import command

    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else fresh_postgres_db()
    assert db.upgrade(url, "0003") == "0003"
    sa_url = url if backend == "sqlite" else url.replace("postgresql://", "postgresql+psycopg://")

    def tables() -> set[str]:
        eng = create_engine(sa_url)
        try:
            insp = inspect(eng)
            names = set(insp.get_table_names())
            cols = {c["name"] for c in insp.get_columns("schedules")}
        finally:
            eng.dispose()
        return names | {f"schedules.{c}" for c in cols}

    assert not {"api_tokens", "schedule_runs", "schedules.start_at"} & tables()
    assert db.upgrade(url) == "0004"
    assert {"api_tokens", "schedule_runs", "schedules.start_at"} <= tables()
    command.downgrade(db.alembic_config(sa_url), "0003")
    assert not {"api_tokens", "schedule_runs", "schedules.start_at"} & tables()
    assert db.upgrade(url) == "0004"


def test_tokens_are_stored_hashed_and_revocable(ledger: str) -> None:
    made = tenants.create_token("acme", name="ci")
    token = made["token"]
    assert token.startswith("bi_") and len(token) > 40
    with tx() as conn:
        rows = [dict(r._mapping) for r in conn.execute(select(api_tokens)).all()]
    assert len(rows) == 1
    assert rows[0]["token_sha256"] == hashlib.sha256(token.encode()).hexdigest()
    assert not any(token in str(v) for v in rows[0].values())    # never the token itself
    assert tenants.authenticate(token) == "acme"
    assert tenants.authenticate(token + "x") is None
    assert tenants.authenticate("Bearer " + token) is None
    listed = tenants.list_tokens("acme")
    assert [t["id"] for t in listed] == [made["id"]] and "token" not in listed[0]
    assert listed[0]["last_used_at"] is not None
    assert tenants.revoke_token(made["id"])["changed"]
    assert tenants.authenticate(token) is None
    assert not tenants.revoke_token(made["id"])["changed"]
    with pytest.raises(LedgerError, match="no token 'tok-nope'"):
        tenants.revoke_token("tok-nope")
    with pytest.raises(LedgerError, match="not a valid name"):
        tenants.create_token("bad tenant!")
