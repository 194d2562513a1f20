"""`batchinf info`: where this batchinf keeps its state, and the versions it runs with."""

from __future__ import annotations

from typing import Any

import click

from batchinf.cli.common import emit, friendly, json_option


def _versions() -> dict[str, str | None]:
    import platform
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "celery", "fastapi", "sqlalchemy", "alembic", "boto3", "pyarrow", "psycopg"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _redact(url: str) -> str:
    """A database or broker URL without its password."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    cred, _, host = rest.rpartition("@")
    return f"{scheme}{sep}{cred.split(':', 1)[0]}:***@{host}" if ":" in cred else url


@click.command("info")
@json_option
@friendly
def info(as_json: bool) -> None:
    """Where the ledger, the bundle store and the caches are (BATCHINF_HOME and friends), and the
    versions of batchinf, Python and its main dependencies. Reads nothing from the ledger."""
    from batchinf.config import default_home, settings
    from batchinf.version import __version__

    s = settings()
    report: dict[str, Any] = {
        "version": __version__,
        "home": str(s.home),
        "home_is_default": s.home == default_home().expanduser().resolve(),
        "ledger": _redact(s.database_url),
        "mode": "embedded" if s.embedded else "distributed",
        "bundle_store": s.bundle_store,
        "bundle_cache": str(s.home / "cache" / "bundles"),
        "broker": _redact(s.broker_url),
        "s3_endpoint": s.s3_endpoint_url,
        "log_format": s.log_format,
        "versions": _versions(),
    }

    def human(r: dict[str, Any]) -> None:
        click.echo(f"batchinf {r['version']}")
        click.echo(f"home          {r['home']}{'  (default; BATCHINF_HOME overrides)' if r['home_is_default'] else ''}")
        for key in ("ledger", "mode", "bundle_store", "bundle_cache", "broker", "s3_endpoint"):
            click.echo(f"{key:<13} {r[key] if r[key] is not None else '-'}")
        click.echo("versions      " + ", ".join(f"{k} {v}" for k, v in r["versions"].items() if v))

    emit(report, as_json, human)


COMMANDS = [info]
