"""CLI commands of the service surface: `serve`, `token`, `schedule`, `scheduler` (registered on
`batchinf.cli.main`). Every result has --json."""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click


def register(main: click.Group, *, friendly: Callable, emit: Callable[[Any, bool, Callable], None]) -> None:
    json_flag = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")

    @main.command()
    @click.option("--host", default="127.0.0.1", show_default=True)
    @click.option("--port", default=8080, show_default=True, type=int)
    @click.option("--log-level", default="info", show_default=True)
    @friendly
    def serve(host: str, port: int, log_level: str) -> None:
        """The REST API over the ledger (OpenAPI document at /openapi.json, docs at /docs)."""
        import uvicorn

        from batchinf.api import create_app

        uvicorn.run(create_app(), host=host, port=port, log_level=log_level, access_log=False)

    @main.group()
    def token() -> None:
        """API bearer tokens: each belongs to one tenant; only its sha256 is stored."""

    @token.command("create")
    @click.option("--tenant", required=True, help="The tenant whose jobs the token reaches.")
    @click.option("--name", default=None, help="A label to recognise the token by.")
    @json_flag
    @friendly
    def token_create(tenant: str, name: str | None, as_json: bool) -> None:
        """Create a token and print it once; it cannot be shown again."""
        from batchinf.tenants import create_token

        emit(create_token(tenant, name), as_json, lambda t: (
            click.echo(t["token"]),
            click.echo(f"{t['id']} for tenant {t['tenant']}: store it now, it is not shown again", err=True)))

    @token.command("list")
    @click.option("--tenant", default=None)
    @json_flag
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
    @json_flag
    @friendly
    def token_revoke(token_id: str, as_json: bool) -> None:
        """Revoke a token by its id (from `token list`); requests with it get 401 from then on."""
        from batchinf.tenants import revoke_token

        emit(revoke_token(token_id), as_json, lambda r: click.echo(f"{r['id']} revoked"))

    @main.group()
    def schedule() -> None:
        """Schedules: a manifest template submitted once per logical date ({ds})."""

    def print_schedules(rows: list[dict[str, Any]]) -> None:
        for r in rows:
            state = "paused" if r["paused"] else "active"
            click.echo(f"{r['name']}  {r['cron']} {r['timezone']}  {state}  runs={r['runs']} "
                       f"last={r['last_ds'] or '-'} next={r['next_fire'] or '-'}")

    @schedule.command("add")
    @click.argument("name")
    @click.argument("template", type=click.Path(exists=True, dir_okay=False))
    @click.option("--cron", "cron_expr", required=True, help="5 fields, e.g. '0 2 * * *'; or @daily.")
    @click.option("--timezone", "tz", default="UTC", show_default=True, help="IANA zone of the cron times.")
    @click.option("--catchup/--no-catchup", default=True, show_default=True,
                  help="Submit every missed date, or only the latest.")
    @click.option("--tenant", envvar="BATCHINF_TENANT", default="default", show_default=True)
    @click.option("--start", default=None, help="First fire time considered (DATE or ISO 8601; default now).")
    @json_flag
    @friendly
    def schedule_add(name: str, template: str, cron_expr: str, tz: str, catchup: bool, tenant: str,
                     start: str | None, as_json: bool) -> None:
        """Add schedule NAME from manifest TEMPLATE, which may use {ds} (YYYY-MM-DD) in its URIs
        and idempotency_key (default key: schedule:NAME:{ds})."""
        from pathlib import Path

        from batchinf import schedules

        row = schedules.add(name, cron_expr, Path(template).read_text(), tz=tz, catchup=catchup,
                            tenant=tenant, start=start)
        emit(row, as_json, lambda r: print_schedules([r]))

    @schedule.command("list")
    @click.option("--tenant", default=None)
    @json_flag
    @friendly
    def schedule_list(tenant: str | None, as_json: bool) -> None:
        """Schedules with their run counts, last logical date and next fire time."""
        from batchinf import schedules

        emit(schedules.list_schedules(tenant), as_json, print_schedules)

    for verb, paused in (("pause", True), ("resume", False)):
        @schedule.command(verb, help=f"{verb.capitalize()} schedule NAME.")
        @click.argument("name")
        @json_flag
        @friendly
        def _toggle(name: str, as_json: bool, paused: bool = paused) -> None:
            from batchinf import schedules

            emit(schedules.set_paused(name, paused), as_json, lambda r: print_schedules([r]))

    def print_runs(rows: list[dict[str, Any]]) -> None:
        for r in rows:
            what = r.get("error") or (("created " if r["created"] else "exists  ") + r["job_id"])
            click.echo(f"{r['schedule']} {r['ds']}  {what}")

    @schedule.command("backfill")
    @click.argument("name")
    @click.option("--from", "first", required=True, type=click.DateTime(["%Y-%m-%d"]))
    @click.option("--to", "last", required=True, type=click.DateTime(["%Y-%m-%d"]))
    @json_flag
    @friendly
    def schedule_backfill(name: str, first: datetime, last: datetime, as_json: bool) -> None:
        """Submit NAME for every date from --from to --to (inclusive) on which its cron fires.
        Dates that already have a job keep it; nothing runs twice. Exits 1 if any date failed."""
        from batchinf import schedules

        rows = schedules.backfill(name, first.date(), last.date())
        emit(rows, as_json, print_runs)
        sys.exit(1 if any(r.get("error") for r in rows) else 0)

    @main.command()
    @click.option("--once", is_flag=True, help="One tick, then exit.")
    @click.option("--now", "now_text", default=None,
                  help="Tick as if it were this ISO 8601 time (implies --once; for tests and replays).")
    @click.option("--interval", default=30.0, show_default=True, help="Seconds between ticks.")
    @click.option("--metrics-port", type=int, default=None)
    @json_flag
    @friendly
    def scheduler(once: bool, now_text: str | None, interval: float, metrics_port: int | None,
                  as_json: bool) -> None:
        """Submit due schedules from the ledger. Restartable; several may run at once: each
        logical date of a schedule gets exactly one job."""
        import logging
        import signal
        import threading

        from batchinf import schedules

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        logging.getLogger("alembic").setLevel(logging.WARNING)
        if now_text is not None:
            now = datetime.fromisoformat(now_text)
            now = now if now.tzinfo else now.replace(tzinfo=UTC)
            emit(schedules.tick(now), as_json, print_runs)
            return
        if metrics_port:
            from batchinf import metrics

            metrics.serve(metrics_port)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        while not stop.is_set():
            try:
                rows = schedules.tick()
                if once:
                    emit(rows, as_json, print_runs)
                    return
            except Exception as exc:
                if once:
                    raise
                logging.getLogger("batchinf.scheduler").warning("tick failed: %s: %s", type(exc).__name__, exc)
            stop.wait(interval)
