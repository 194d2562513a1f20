"""`batchinf dev cluster|down`: a local distributed cluster for trying distributed mode."""

from __future__ import annotations

import click

from batchinf.cli import common
from batchinf.cli.common import emit, friendly, json_option


@click.group("dev")
def dev() -> None:
    """A local cluster on loopback: PostgreSQL, Redis, an S3 server, a controller and workers."""


@dev.command("cluster")
@click.option("--workers", default=2, show_default=True, help="Celery workers to start (one process each).")
@click.option("--database-url", default=None,
              help="An existing PostgreSQL server to create the ledger database on (default: a temporary "
                   "cluster made with initdb).")
@click.option("--broker-url", default=None,
              help="An existing Redis (redis://HOST:PORT/DB; the cluster gets a queue of its own; default: a "
                   "redis-server of its own).")
@json_option
@friendly
def cluster(workers: int, database_url: str | None, broker_url: str | None, as_json: bool) -> None:
    """Start a local cluster (or show the one already up) and print the environment to export:
    `eval "$(batchinf dev cluster)"`, then `batchinf submit` runs there. `--json`: one object of
    the variables. `batchinf dev down` stops it."""
    from batchinf.dev_cluster import BUCKET, exports, up

    with common.console.status("starting PostgreSQL, Redis, an S3 server, a controller and workers"):
        c = up(workers, database_url=database_url, broker_url=broker_url)
    emit(c.env, as_json, lambda env: click.echo(exports(env)))
    if not as_json:
        common.console.print(f"# a dev cluster is up: {', '.join(c.pids)}; bucket s3://{BUCKET}/ (versioned; put "
                             f"inputs under s3://{BUCKET}/data/); logs in {c.root}; stop it with `batchinf dev down`",
                             highlight=False, soft_wrap=True)


@dev.command("down")
@json_option
@friendly
def down(as_json: bool) -> None:
    """Stop the local cluster `batchinf dev cluster` started and remove what it created."""
    from batchinf.dev_cluster import down as stop

    emit(stop(), as_json, lambda r: click.echo(r.get("message") or f"stopped: {', '.join(r['stopped'])}"))


COMMANDS = [dev]
