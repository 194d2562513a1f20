"""`batchinf db upgrade`: the ledger's Alembic migrations."""

from __future__ import annotations

import click

from batchinf.cli.common import emit, friendly, json_option


@click.group("db")
def db() -> None:
    """Ledger database."""


@db.command("upgrade")
@json_option
@friendly
def db_upgrade(as_json: bool) -> None:
    """Run the Alembic migrations on BATCHINF_DATABASE_URL (default: SQLite under BATCHINF_HOME)."""
    from batchinf.config import settings
    from batchinf.ledger.db import upgrade

    rev = upgrade()
    url = settings().database_url
    emit({"database": url.split("@")[-1], "revision": rev}, as_json,
         lambda r: click.echo(f"{r['database']} at revision {r['revision']}"))


COMMANDS = [db]
