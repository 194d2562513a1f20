"""`tenant limit TENANT NAME VALUE` (or `--unset`): one tenant's bound on a number it may set.

The command belongs to the `tenant` group (cli/tenants.py adds it there).
"""

from __future__ import annotations

from typing import Any

import click

from batchinf.cli.common import emit, friendly, json_option
from batchinf.config import LIMITS



def _print_limits(result: dict[str, Any]) -> None:
    for name, value in result["limits"].items():
        mark = "" if name not in result["overrides"] else "  (this tenant)"
        click.echo(f"{name:<18} {value}{mark}")


@click.command("limit")
@click.argument("tenant")
@click.argument("name", type=click.Choice(sorted(LIMITS)))
@click.argument("value", required=False, type=int)
@click.option("--unset", is_flag=True, help="Remove the tenant's own value: the operator's default applies.")
@json_option
@friendly
def tenant_limit(tenant: str, name: str, value: int | None, unset: bool, as_json: bool) -> None:
    """Set TENANT's limit NAME to VALUE (or --unset it). Limits bound the numbers a manifest may
    set (priority range, batch and shard sizes, generated tokens, the KV cache a generate job
    implies); their defaults come from the BATCHINF_* variables in `config.LIMITS`."""
    from batchinf import limits

    if unset == (value is not None):
        raise click.UsageError("give VALUE, or --unset (not both)")
    effective = limits.set_tenant_limit(tenant, name, None if unset else value)
    emit({"tenant": tenant, "limits": effective, "overrides": limits.overrides(tenant)}, as_json, _print_limits)
