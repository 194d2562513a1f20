"""`tenant grant|revoke|show|limit`: the storage prefixes each tenant may read and write, and its limits."""

from __future__ import annotations

from typing import Any

import click

from batchinf.cli.common import emit, friendly, json_option
from batchinf.cli.limits import tenant_limit


def _print(r: dict[str, Any]) -> None:
    click.echo(f"tenant {r['tenant']}")
    for g in r["grants"] or [{"prefix": "(no grants: confined jobs of this tenant may touch nothing)", "mode": ""}]:
        click.echo(f"  {g['mode']:5}  {g['prefix']}")
    for name, value in sorted(r["limits"].items()):
        click.echo(f"  limit  {name} = {value}")


@click.group("tenant")
def tenant() -> None:
    """Tenants' storage scopes: jobs submitted through the API may read only granted prefixes and
    write only granted write prefixes; CLI jobs are checked once their tenant has grants."""


@tenant.command("grant")
@click.argument("name")
@click.option("--read", "read", multiple=True, metavar="PREFIX", help="A prefix the tenant may read (repeatable).")
@click.option("--write", "write", multiple=True, metavar="PREFIX",
              help="A prefix the tenant may read and write (repeatable).")
@json_option
@friendly
def tenant_grant(name: str, read: tuple[str, ...], write: tuple[str, ...], as_json: bool) -> None:
    """Grant tenant NAME prefixes (s3://bucket/prefix/, file:///dir/ or a local directory)."""
    from batchinf import scopes

    if not read and not write:
        raise click.UsageError("give at least one --read PREFIX or --write PREFIX")
    emit(scopes.grant(name, read=list(read), write=list(write)), as_json, _print)


@tenant.command("revoke")
@click.argument("name")
@click.argument("prefix")
@json_option
@friendly
def tenant_revoke(name: str, prefix: str, as_json: bool) -> None:
    """Remove tenant NAME's grants of PREFIX (read and write). Jobs already submitted keep running."""
    from batchinf import scopes

    emit(scopes.revoke(name, prefix), as_json, _print)


@tenant.command("show")
@click.argument("name")
@json_option
@friendly
def tenant_show(name: str, as_json: bool) -> None:
    """Tenant NAME's grants and limits."""
    from batchinf import scopes

    emit(scopes.show(name), as_json, _print)


tenant.add_command(tenant_limit)
COMMANDS = [tenant]
