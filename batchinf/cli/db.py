"""`batchinf db upgrade|current|history|downgrade|check`: the ledger's Alembic migrations."""

from __future__ import annotations

import sys

import click

from batchinf.cli.common import emit, friendly, json_option


@click.group("db")
def db() -> None:
    """Ledger database (Alembic migrations on BATCHINF_DATABASE_URL)."""


def _where() -> str:
    from batchinf.config import settings

    return settings().database_url.split("@")[-1]


@db.command("upgrade")
@click.argument("revision", default="head")
@json_option
@friendly
def db_upgrade(revision: str, as_json: bool) -> None:
    """Run the Alembic migrations up to REVISION (default head) on BATCHINF_DATABASE_URL (default:
    SQLite under BATCHINF_HOME)."""
    from batchinf.ledger.db import upgrade

    rev = upgrade(revision=revision)
    emit({"database": _where(), "revision": rev}, as_json,
         lambda r: click.echo(f"{r['database']} at revision {r['revision']}"))


@db.command("downgrade")
@click.argument("revision")
@click.option("--yes", is_flag=True, help="Do not ask; a downgrade drops the columns and tables of later revisions.")
@json_option
@friendly
def db_downgrade(revision: str, yes: bool, as_json: bool) -> None:
    """Undo migrations down to REVISION (e.g. 0006, or -1 for one step back). Drops what later
    revisions added: stop every controller, worker and API first."""
    from batchinf.ledger.db import downgrade

    if not yes:
        click.confirm(f"downgrade {_where()} to {revision}? data in later revisions' columns is lost", abort=True,
                      err=True)
    emit({"database": _where(), "revision": downgrade(revision)}, as_json,
         lambda r: click.echo(f"{r['database']} at revision {r['revision']}"))


@db.command("current")
@json_option
@friendly
def db_current(as_json: bool) -> None:
    """The ledger's revision and this batchinf's head revision."""
    from batchinf.ledger.db import state

    emit({"database": _where(), **state()}, as_json, lambda r: click.echo(
        f"{r['database']} at revision {r['current'] or '(empty)'}; this batchinf's head is {r['head']}"
        + ("" if r["up_to_date"] else ": run `batchinf db upgrade`")))


@db.command("history")
@json_option
@friendly
def db_history(as_json: bool) -> None:
    """Every migration this batchinf ships, oldest first, with the current one marked."""
    from batchinf.ledger.db import history, state

    current = state()["current"]
    rows = [dict(r, current=r["revision"] == current) for r in history()]
    emit(rows, as_json, lambda rs: [click.echo(f"{'*' if r['current'] else ' '} {r['revision']}  "
                                               f"(from {r['down_revision'] or '-'})  {r['doc']}") for r in rs])


@db.command("check")
@json_option
@friendly
def db_check(as_json: bool) -> None:
    """Exit 0 when the ledger is at this batchinf's head revision, 1 when it needs `db upgrade`
    (for deploy scripts and readiness checks)."""
    from batchinf.ledger.db import state

    r = {"database": _where(), **state()}
    emit(r, as_json, lambda r: click.echo(
        f"{r['database']}: up to date at {r['head']}" if r["up_to_date"]
        else f"{r['database']}: at {r['current'] or '(empty)'}, head is {r['head']}: run `batchinf db upgrade`"))
    sys.exit(0 if r["up_to_date"] else 1)


COMMANDS = [db]
