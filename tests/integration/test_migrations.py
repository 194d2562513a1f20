"""The whole migration chain, on SQLite and PostgreSQL: every revision upgrades, downgrades to
the start and upgrades again, and head holds the tables the ledger declares."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from batchinf.ledger import db
from batchinf.ledger.tables import metadata
from tests.helpers.services import fresh_postgres_db as _fresh_postgres_db

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_every_revision_goes_down_and_up_again(backend: str, tmp_path: Path) -> None:
    from alembic import command
    from alembic.script import ScriptDirectory

    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else _fresh_postgres_db()
    sa_url = url if backend == "sqlite" else url.replace("postgresql://", "postgresql+psycopg://")
    script = ScriptDirectory.from_config(db.alembic_config(sa_url))
    revisions = [r.revision for r in reversed(list(script.walk_revisions()))]
    assert len(script.get_heads()) == 1, f"the chain must have one head, got {script.get_heads()}"

    def columns() -> dict[str, set[str]]:
        eng = create_engine(sa_url)
        try:
            insp = inspect(eng)
            return {t: {c["name"] for c in insp.get_columns(t)} for t in insp.get_table_names()
                    if t != "alembic_version"}
        finally:
            eng.dispose()

    seen = []
    for rev in revisions:
        assert db.upgrade(url, rev) == rev
        seen.append(columns())
    declared = {t.name: {c.name for c in t.columns} for t in metadata.sorted_tables}
    assert seen[-1] == declared, "head differs from ledger/tables.py"
    for rev, expected in zip(reversed(revisions[:-1]), reversed(seen[:-1])):
        command.downgrade(db.alembic_config(sa_url), rev)
        assert columns() == expected, f"downgrade to {rev} does not restore its schema"
    assert db.upgrade(url) == revisions[-1]
    assert columns() == declared
