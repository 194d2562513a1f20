"""What every command module shares: the stderr console, `emit` (--json or a human rendering),
`friendly` (deliberate errors as one line, exit 2), the shared options, progress bars and the
human job status."""

from __future__ import annotations

import json
import sys
from functools import wraps
from typing import Any, Callable, TypeVar

import click
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from batchinf.errors import BatchinfError

F = TypeVar("F", bound=Callable[..., Any])

console = Console(stderr=True)   # progress, notes and errors


def stdout_console() -> Console:
    """A console for results on stdout: at a terminal, fitted to it; piped or redirected, as wide
    as the content, so ids and digests are never cut (what `bundle list` prints, `bundle alias`
    accepts)."""
    c = Console()
    return c if c.is_terminal else Console(width=100_000, soft_wrap=True)


def emit(obj: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    """Print a command's result: as JSON on stdout with --json, else through `human`."""
    if as_json:
        click.echo(json.dumps(obj, indent=1, default=str))
    else:
        human(obj)


def friendly(fn: F) -> F:
    """Errors batchinf raises on purpose print as one line naming the fix, never a traceback."""
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BatchinfError as exc:
            from rich.markup import escape

            console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
            sys.exit(2)
    return wrapper  # type: ignore[return-value]


json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
tenant_option = click.option("--tenant", envvar="BATCHINF_TENANT", default="default", show_default=True,
                             help="Tenant the job belongs to (env BATCHINF_TENANT).")
tenant_filter = click.option("--tenant", envvar="BATCHINF_TENANT", default=None,
                             help="Only this tenant's jobs (env BATCHINF_TENANT; default: all).")
metrics_port_option = click.option("--metrics-port", type=int, default=None,
                                   help="Serve this process's Prometheus metrics on this port.")


def progress(as_json: bool) -> Progress:
    """A records progress bar on stderr; silent with --json or when stderr is not a terminal. It is
    drawn at each tick (`ticker`), not by a thread of its own: a driver with no other thread forks
    its workers (dispatch.start_method)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("records"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, auto_refresh=False,
                    disable=as_json or not console.is_terminal)


def ticker(bar_progress: Progress, job_id: str) -> Callable[[], dict[str, Any]]:
    """Refresh the progress bar from the ledger's status model; returns that status."""
    from batchinf.ledger.status import status

    bar = bar_progress.add_task(job_id, total=None, rate="")

    def tick() -> dict[str, Any]:
        s = status(job_id)
        bar_progress.update(bar, total=s["counts"]["records_total"], completed=s["counts"]["records_done"],
                            description=f"{job_id} {s['status']}")
        speed = bar_progress.tasks[0].speed
        bar_progress.update(bar, rate=f"{speed:,.0f}/s" if speed else "")
        bar_progress.refresh()
        return s
    return tick


def print_status(s: dict[str, Any]) -> None:
    """One job's status object (`batchinf.ledger.status.status`) as a few lines on stdout."""
    c, sh = s["counts"], s["shards"]
    from batchinf.ledger.states import JobStatus

    o = stdout_console()
    color = {JobStatus.SUCCEEDED: "green", JobStatus.FAILED: "red"}.get(s["status"], "yellow")
    o.print(f"[bold]{s['job_id']}[/bold] {s['name']}: [{color}]{s['status']}[/{color}]", highlight=False)
    o.print(f"  records  {c['records_succeeded']} ok, {c['records_failed']} errors, "
            f"{c['records_total'] if c['records_total'] is not None else '?'} total", highlight=False)
    o.print(f"  shards   {sh['committed']}/{sh['total']} committed, {sh['running']} running, "
            f"{sh['pending']} pending", highlight=False)
    p = s.get("progress") or {}
    if p.get("audio_seconds_planned") is not None:
        rate = p.get("audio_seconds_per_second")
        o.print(f"  audio    {p['audio_seconds_done'] / 3600:.2f} of {p['audio_seconds_planned'] / 3600:.2f} hours"
                + (f", {rate:.1f} audio-seconds/s" if rate else ""), highlight=False)
    if p.get("steps_planned") is not None:
        o.print(f"  steps    {p['steps_done']} of {p['steps_planned']} denoising steps", highlight=False)
    pinned = "" if s["bundle"] == s["bundle_digest"] else f" ({s['bundle_digest']})"    # a job named by digest
    o.print(f"  bundle   {s['bundle']}{pinned}", highlight=False)
    o.print(f"  output   {s['output_uri']}", highlight=False)
    if (ph := s.get("phases")) and ph.get("wall") is not None:
        from batchinf.phases import PHASES

        said = ", ".join(f"{k} {ph[k]:.2f}" for k in PHASES if ph.get(k) is not None)
        o.print(f"  phases   {said} (wall {ph['wall']:.2f} s)", highlight=False)
    if s.get("error"):
        o.print(f"  [red]error[/red]    {s['error']}", highlight=False)
