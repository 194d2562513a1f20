"""The service surface: `serve` (the REST API) and `token create|list|revoke` (its bearer tokens)."""

from __future__ import annotations

from typing import Any

import click

from batchinf.cli.common import emit, friendly, json_option


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--log-level", default="info", show_default=True)
@click.option("--workers", default=1, show_default=True, type=int,
              help="Embedded ledger: local worker processes that run the jobs' shards.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--lanes", default=1, show_default=True, type=int,
              help="Embedded ledger: shards each worker process runs at once, a thread each, sharing its loaded model.")
@click.option("--threads", type=int, default=None, help="Torch threads per lane (default: cores / (workers x lanes)).")
@click.option("--engine", "engines", multiple=True, type=click.Choice(["native", "vllm", "openai-http", "onnxruntime"]),
              help="Embedded ledger: an engine the local workers have (repeat for several; default native, and "
              "onnxruntime where installed); jobs on other engines wait queued.")
@friendly
def serve(host: str, port: int, log_level: str, workers: int, lanes: int, device: str, threads: int | None,
          engines: tuple[str, ...]) -> None:
    """The REST API over the ledger (OpenAPI document at /openapi.json, docs at /docs), with the
    OpenAI-compatible /v1/files and /v1/batches. On the embedded (SQLite) ledger it also runs what
    the jobs need on this machine: a controller loop, --workers local worker processes and the
    scheduler, so `batchinf serve` alone is a working batch server. In distributed mode it is
    only the API; controllers and workers run the jobs."""
    import threading

    import uvicorn

    from batchinf.api import create_app
    from batchinf.config import settings

    stop = threading.Event()
    runners = []
    if settings().embedded:
        from batchinf.controller import serve_embedded
        from batchinf.ledger.db import engine

        engine()       # create or upgrade the embedded ledger before anything else touches it
        runners = serve_embedded(stop, workers=workers, lanes=lanes, device=device, threads=threads,
                                 engines=engines or None)
        click.echo(f"embedded ledger {settings().database_url}: running jobs here with {workers} worker "
                   "process(es), a controller loop and the scheduler", err=True)
    try:
        # log_config=None: uvicorn's loggers go through batchinf's one configuration (`--log-format`)
        uvicorn.run(create_app(), host=host, port=port, log_level=log_level, access_log=False, log_config=None)
    finally:
        stop.set()
        for t in runners:
            t.join(timeout=15)


@click.group("token")
def token() -> None:
    """API bearer tokens: each belongs to one tenant; only its sha256 is stored."""


@token.command("create")
@click.option("--tenant", required=True, help="The tenant whose jobs the token reaches.")
@click.option("--name", default=None, help="A label to recognise the token by.")
@json_option
@friendly
def token_create(tenant: str, name: str | None, as_json: bool) -> None:
    """Create a token and print it once; it cannot be shown again."""
    from batchinf.tenants import create_token

    emit(create_token(tenant, name), as_json, lambda t: (
        click.echo(t["token"]),
        click.echo(f"{t['id']} for tenant {t['tenant']}: store it now, it is not shown again", err=True)))


@token.command("list")
@click.option("--tenant", default=None)
@json_option
@friendly
def token_list(tenant: str | None, as_json: bool) -> None:
    """Tokens (ids, tenants, use and revocation times; never the tokens themselves)."""
    from batchinf.tenants import list_tokens

    def human(rows: list[dict[str, Any]]) -> None:
        for r in rows:
            state = "revoked" if r["revoked_at"] else "active"
            click.echo(f"{r['id']}  {r['tenant']}  {state}  {r['name'] or ''}")

    emit(list_tokens(tenant), as_json, human)


@token.command("revoke")
@click.argument("token_id")
@json_option
@friendly
def token_revoke(token_id: str, as_json: bool) -> None:
    """Revoke a token by its id (from `token list`); requests with it get 401 from then on."""
    from batchinf.tenants import revoke_token

    emit(revoke_token(token_id), as_json, lambda r: click.echo(f"{r['id']} revoked"))


COMMANDS = [serve, token]
