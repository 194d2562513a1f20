"""Schedules: `schedule add|list|pause|resume|backfill` and the `scheduler` process."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from typing import Any

import click

from batchinf.cli.common import emit, friendly, json_option, metrics_port_option


def print_schedules(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        state = "paused" if r["paused"] else "active"
        click.echo(f"{r['name']}  {r['cron']} {r['timezone']}  {state}  runs={r['runs']} "
                   f"last={r['last_ds'] or '-'} next={r['next_fire'] or '-'}")


def print_runs(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        what = r.get("error") or (("created " if r["created"] else "exists  ") + r["job_id"])
        click.echo(f"{r['schedule']} {r['ds']}  {what}")


@click.group("schedule")
def schedule() -> None:
    """Schedules: a manifest template submitted once per logical date ({ds})."""


@schedule.command("add")
@click.argument("name")
@click.argument("template", type=click.Path(exists=True, dir_okay=False))
@click.option("--cron", "cron_expr", required=True, help="5 fields, e.g. '0 2 * * *'; or @daily.")
@click.option("--timezone", "tz", default="UTC", show_default=True, help="IANA zone of the cron times.")
@click.option("--catchup/--no-catchup", default=True, show_default=True,
              help="Submit every missed date, or only the latest.")
@click.option("--tenant", envvar="BATCHINF_TENANT", default="default", show_default=True)
@click.option("--start", default=None, help="First fire time considered (DATE or ISO 8601; default now).")
@json_option
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
@json_option
@friendly
def schedule_list(tenant: str | None, as_json: bool) -> None:
    """Schedules with their run counts, last logical date and next fire time."""
    from batchinf import schedules

    emit(schedules.list_schedules(tenant), as_json, print_schedules)


def _toggle_command(verb: str, paused: bool) -> click.Command:
    """`schedule pause` and `schedule resume`: the same command but for the state they set."""
    @click.command(verb, help=f"{verb.capitalize()} schedule NAME.")
    @click.argument("name")
    @json_option
    @friendly
    def toggle(name: str, as_json: bool) -> None:
        from batchinf import schedules

        emit(schedules.set_paused(name, paused), as_json, lambda r: print_schedules([r]))
    return toggle


for _verb, _paused in (("pause", True), ("resume", False)):
    schedule.add_command(_toggle_command(_verb, _paused))


@schedule.command("backfill")
@click.argument("name")
@click.option("--from", "first", required=True, type=click.DateTime(["%Y-%m-%d"]))
@click.option("--to", "last", required=True, type=click.DateTime(["%Y-%m-%d"]))
@json_option
@friendly
def schedule_backfill(name: str, first: datetime, last: datetime, as_json: bool) -> None:
    """Submit NAME for every date from --from to --to (inclusive) on which its cron fires.
    Dates that already have a job keep it; nothing runs twice. Exits 1 if any date failed."""
    from batchinf import schedules

    rows = schedules.backfill(name, first.date(), last.date())
    emit(rows, as_json, print_runs)
    sys.exit(1 if any(r.get("error") for r in rows) else 0)


@click.command("scheduler")
@click.option("--once", is_flag=True, help="One tick, then exit.")
@click.option("--now", "now_text", default=None,
              help="Tick as if it were this ISO 8601 time (implies --once; for tests and replays).")
@click.option("--interval", default=30.0, show_default=True, help="Seconds between ticks.")
@metrics_port_option
@json_option
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


COMMANDS = [schedule, scheduler]
