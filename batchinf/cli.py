"""`batchinf` command line: a thin wrapper over the library. Every result has --json."""

from __future__ import annotations

import json
import sys
from functools import wraps
from typing import Any, Callable

import click
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table

from batchinf.errors import BatchinfError

console = Console(stderr=True)


def _emit(obj: Any, as_json: bool, human: Callable[[Any], None]) -> None:
    if as_json:
        click.echo(json.dumps(obj, indent=1, default=str))
    else:
        human(obj)


def friendly(fn: Callable) -> Callable:
    """Errors batchinf raises on purpose print as one line naming the fix, never a traceback."""
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BatchinfError as exc:
            console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            sys.exit(2)
    return wrapper


TENANT_OPTION = click.option("--tenant", envvar="BATCHINF_TENANT", default="default", show_default=True,
                             help="Tenant the job belongs to (env BATCHINF_TENANT).")
TENANT_FILTER = click.option("--tenant", envvar="BATCHINF_TENANT", default=None,
                             help="Only this tenant's jobs (env BATCHINF_TENANT; default: all).")


@click.group()
@click.version_option(package_name="batchinf")
def main() -> None:
    """Durable batch inference over object storage."""


def _print_status(s: dict[str, Any]) -> None:
    c, sh = s["counts"], s["shards"]
    color = {"succeeded": "green", "failed": "red"}.get(s["status"], "yellow")
    console.print(f"[bold]{s['job_id']}[/bold] {s['name']}: [{color}]{s['status']}[/{color}]", highlight=False)
    console.print(f"  records  {c['records_succeeded']} ok, {c['records_failed']} errors, "
                  f"{c['records_total'] if c['records_total'] is not None else '?'} total", highlight=False)
    console.print(f"  shards   {sh['committed']}/{sh['total']} committed, {sh['running']} running, "
                  f"{sh['pending']} pending", highlight=False)
    console.print(f"  bundle   {s['bundle']} ({s['bundle_digest'][:19]}…)", highlight=False)
    console.print(f"  output   {s['output_uri']}", highlight=False)
    if s.get("error"):
        console.print(f"  [red]error[/red]    {s['error']}", highlight=False)


@main.command()
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False))
@click.option("--workers", default=1, show_default=True, help="Local worker processes.")
@click.option("--threads", type=int, default=None, help="Torch threads per worker (default: cores / workers).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the final status as JSON.")
@TENANT_OPTION
@friendly
def run(manifest: str, workers: int, threads: int | None, device: str, as_json: bool, tenant: str) -> None:
    """Run a job to completion on this machine (embedded mode). Re-running the same manifest
    resumes the same job from the ledger. Exits 0 only when the job succeeded."""
    from batchinf.controller import drive
    from batchinf.ledger.status import status
    from batchinf.submit import submit
    from batchinf.manifest import load_manifest

    job_id, created = submit(load_manifest(manifest), tenant=tenant)
    if not created and not as_json:
        console.print(f"resuming {job_id}", highlight=False)
    with _progress(as_json) as progress:
        tick = _ticker(progress, job_id)
        try:
            final = drive(job_id, workers=workers, device=device, threads=threads, on_tick=tick)
        except KeyboardInterrupt:
            progress.stop()
            console.print(f"interrupted; committed shards are kept. Run `batchinf run {manifest}` "
                          "again to resume.", highlight=False)
            sys.exit(130)
    s = status(job_id)
    _emit(s, as_json, _print_status)
    sys.exit(0 if final == "succeeded" else 1)


def _progress(as_json: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("records"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=console, disable=as_json or not console.is_terminal)


def _ticker(progress: Progress, job_id: str) -> Callable[[], dict[str, Any]]:
    """Refresh the progress bar from the ledger's status model; returns that status."""
    from batchinf.ledger.status import status

    bar = progress.add_task(job_id, total=None, rate="")

    def tick() -> dict[str, Any]:
        s = status(job_id)
        progress.update(bar, total=s["counts"]["records_total"], completed=s["counts"]["records_done"],
                        description=f"{job_id} {s['status']}")
        speed = progress.tasks[0].speed
        progress.update(bar, rate=f"{speed:,.0f}/s" if speed else "")
        return s
    return tick


@main.command()
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False))
@click.option("--wait", is_flag=True, help="Wait for the job to finish, with a progress bar.")
@click.option("--json", "as_json", is_flag=True)
@TENANT_OPTION
@friendly
def submit(manifest: str, wait: bool, as_json: bool, tenant: str) -> None:
    """Submit a job to the ledger; a controller and workers run it (distributed mode).
    With --wait, exits 0 only if the job succeeded."""
    import time

    from batchinf.ledger.status import status
    from batchinf.submit import submit as do_submit
    from batchinf.ledger.states import JOB_TERMINAL
    from batchinf.manifest import load_manifest

    job_id, _ = do_submit(load_manifest(manifest), tenant=tenant)
    s = status(job_id)
    if wait:
        with _progress(as_json) as progress:
            tick = _ticker(progress, job_id)
            while (s := tick())["status"] not in JOB_TERMINAL:
                time.sleep(1.0)
    _emit(s, as_json, _print_status)
    if wait:
        sys.exit(0 if s["status"] == "succeeded" else 1)


METRICS_PORT = click.option("--metrics-port", type=int, default=None,
                            help="Serve this process's Prometheus metrics on this port.")


@main.command()
@click.option("--concurrency", default=1, show_default=True, help="Worker processes.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--threads", type=int, default=None, help="Torch threads per process (default: cores / concurrency).")
@METRICS_PORT
@friendly
def worker(concurrency: int, device: str, threads: int | None, metrics_port: int | None) -> None:
    """A Celery worker (distributed mode). Its processes keep loaded bundles cached by digest."""
    import os

    if metrics_port:
        import tempfile

        # before prometheus_client is first imported, so that forked children share the counters
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="batchinf-metrics-")
        from batchinf import metrics

        metrics.serve(metrics_port)
    os.environ["BATCHINF_DEVICE"] = device
    os.environ.setdefault("OMP_NUM_THREADS", str(threads or max(1, (os.cpu_count() or 1) // concurrency)))
    from workers.celery_app import QUEUE, app

    app.worker_main(["worker", "--concurrency", str(concurrency), "--pool", "prefork", "-Q", QUEUE,
                     "--loglevel", "INFO", "--without-gossip", "--without-mingle",
                     "-n", f"batchinf-{os.getpid()}@%h"])


@main.command()
@click.option("--max-in-flight", default=16, show_default=True,
              help="Shards queued or running across all jobs; free slots go by priority, deadline, then round-robin.")
@click.option("--requeue-seconds", default=30.0, show_default=True,
              help="Send a queued shard's message again after this long (lost messages).")
@click.option("--tick", default=1.0, show_default=True, help="Seconds between passes over the ledger.")
@METRICS_PORT
@friendly
def controller(max_in_flight: int, requeue_seconds: float, tick: float, metrics_port: int | None) -> None:
    """Plan, dispatch, recover and publish every job in the ledger (distributed mode). Restartable;
    several may run at once."""
    import logging
    import signal
    import threading

    from batchinf.controller import Controller

    if metrics_port:
        from batchinf import metrics

        metrics.serve(metrics_port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    from workers.celery_app import CeleryDispatcher

    Controller(CeleryDispatcher(requeue_seconds), max_in_flight=max_in_flight, tick_seconds=tick).run_forever(stop)


@main.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True)
@TENANT_FILTER
@friendly
def status(job_id: str, as_json: bool, tenant: str | None) -> None:
    """Show one job's status (the same object as GET /v1/jobs/ID)."""
    from batchinf.ledger.status import status as job_status

    _emit(job_status(job_id, tenant=tenant), as_json, _print_status)


@main.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True)
@TENANT_FILTER
@friendly
def cancel(job_id: str, as_json: bool, tenant: str | None) -> None:
    """Cancel a job: dispatch stops, running attempts stop within a heartbeat, committed results
    stay and `_PARTIAL.json` describes what is done. `_SUCCESS` is never written."""
    from batchinf.controller import cancel as do_cancel
    from batchinf.ledger.status import status as job_status

    job_status(job_id, tenant=tenant)
    do_cancel(job_id)
    _emit(job_status(job_id), as_json, _print_status)


@main.command()
@click.option("--limit", default=50, show_default=True)
@click.option("--status", "status_is", default=None, help="Only jobs in this state.")
@click.option("--name", default=None, help="Only jobs with this manifest name.")
@click.option("--schedule", default=None, help="Only jobs made by this schedule.")
@click.option("--json", "as_json", is_flag=True)
@TENANT_FILTER
@friendly
def jobs(limit: int, status_is: str | None, name: str | None, schedule: str | None, as_json: bool,
         tenant: str | None) -> None:
    """List recent jobs, newest first (the same objects as GET /v1/jobs)."""
    from batchinf.ledger.status import list_jobs

    def human(rows: list[dict[str, Any]]) -> None:
        t = Table("job", "name", "status", "records ok", "errors", "shards")
        for s in rows:
            t.add_row(s["job_id"], s["name"], s["status"], str(s["counts"]["records_succeeded"]),
                      str(s["counts"]["records_failed"]), f"{s['shards']['committed']}/{s['shards']['total']}")
        Console().print(t)

    _emit(list_jobs(limit, tenant=tenant, status_is=status_is, name=name, schedule=schedule), as_json, human)


@main.command()
@click.argument("job_or_uri")
@click.option("--json", "as_json", is_flag=True)
@friendly
def verify(job_or_uri: str, as_json: bool) -> None:
    """Re-check a published output (coverage, part digests, row counts). Non-zero exit on mismatch."""
    from batchinf.errors import VerificationError
    from batchinf.verify import verify_output

    uri = job_or_uri
    if job_or_uri.startswith("job-"):
        from batchinf.ledger.jobs import get as job_row

        uri = job_row(job_or_uri).output_uri
    try:
        report = verify_output(uri)
    except VerificationError as exc:
        report = {"ok": False, "output_uri": uri, "error": str(exc)}
    _emit(report, as_json, lambda r: console.print(
        f"[green]ok[/green] {r['output_uri']}: {r['parts']} parts, {r['counts']}" if r["ok"]
        else f"[red]mismatch[/red] {r['output_uri']}: {r['error']}", highlight=False))
    sys.exit(0 if report["ok"] else 1)


@main.group()
def bundle() -> None:
    """Model bundles: import, list, verify, alias."""


@bundle.command("import")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--name", required=True)
@click.option("--alias", default=None)
@click.option("--max-length", type=int, default=None, help="Default: the model's own setting.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True, help="Compute dtype on CUDA (CPU always runs float32).")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bundle_import(directory: str, name: str, alias: str | None, max_length: int | None, dtype: str,
                  as_json: bool) -> None:
    """Import a model directory as a bundle; prints its digest."""
    from batchinf.bundles import import_bundle

    info = import_bundle(directory, name, alias=alias, max_length=max_length, dtype=dtype)
    _emit(info.to_dict(), as_json, lambda i: click.echo(i["digest"]))


@bundle.command("import-gguf")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--name", required=True)
@click.option("--alias", default=None)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Stored weights and CUDA compute dtype (CPU always runs float32).")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bundle_import_gguf(file: str, name: str, alias: str | None, dtype: str, as_json: bool) -> None:
    """Convert a GGUF Llama-family model (dequantised) into a bundle; prints its digest."""
    from batchinf.bundles import import_gguf

    info = import_gguf(file, name, alias=alias, dtype=dtype)
    _emit(info.to_dict(), as_json, lambda i: click.echo(i["digest"]))


@bundle.command("list")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bundle_list(as_json: bool) -> None:
    """List imported bundles and their aliases."""
    from batchinf.bundles import list_bundles

    def human(rows: list[dict[str, Any]]) -> None:
        t = Table("name", "digest", "task", "aliases")
        for b in rows:
            t.add_row(b["name"], b["digest"], b["task"], ", ".join(b["aliases"]))
        Console().print(t)

    _emit([b.to_dict() for b in list_bundles()], as_json, human)


@bundle.command("verify")
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bundle_verify(ref: str, as_json: bool) -> None:
    """Check every file digest and fixture of a bundle (NAME, NAME@ALIAS or sha256:HEX)."""
    from batchinf.bundles import verify_bundle

    _emit(verify_bundle(ref), as_json, lambda r: click.echo(f"ok {r['digest']}"))


@bundle.command("alias")
@click.argument("ref")
@click.argument("digest")
@click.option("--json", "as_json", is_flag=True)
@friendly
def bundle_alias(ref: str, digest: str, as_json: bool) -> None:
    """Point NAME@ALIAS at DIGEST. Jobs already submitted keep the digest they resolved."""
    from batchinf.bundles import set_alias

    set_alias(ref, digest)
    _emit({"alias": ref, "digest": digest}, as_json, lambda r: click.echo(f"{r['alias']} -> {r['digest']}"))


@main.group()
def db() -> None:
    """Ledger database."""


@db.command("upgrade")
@click.option("--json", "as_json", is_flag=True)
@friendly
def db_upgrade(as_json: bool) -> None:
    """Run the Alembic migrations on BATCHINF_DATABASE_URL (default: SQLite under BATCHINF_HOME)."""
    from batchinf.config import settings
    from batchinf.ledger.db import upgrade

    rev = upgrade()
    url = settings().database_url
    _emit({"database": url.split("@")[-1], "revision": rev}, as_json,
          lambda r: click.echo(f"{r['database']} at revision {r['revision']}"))


from batchinf.service_cli import register  # serve, token, schedule, scheduler

register(main, friendly=friendly, emit=_emit)

if __name__ == "__main__":
    main()
