"""Job commands: `run` (embedded mode), `submit`, `status`, `cancel`, `jobs`, `verify`."""

from __future__ import annotations

import sys
from typing import Any

import click
from rich.table import Table

from batchinf.cli.common import (console, emit, friendly, json_option, print_status, progress, stdout_console,
                                 tenant_filter, tenant_option, ticker)
from batchinf.ledger.states import JobStatus


@click.command("run")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False))
@click.option("--workers", default=1, show_default=True, help="Local worker processes.")
@click.option("--threads", type=int, default=None, help="Torch threads per worker (default: cores / workers).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@json_option
@tenant_option
@friendly
def run(manifest: str, workers: int, threads: int | None, device: str, as_json: bool, tenant: str) -> None:
    """Run a job to completion on this machine (embedded mode). Re-running the same manifest
    resumes the same job from the ledger. Exits 0 only when the job succeeded."""
    from batchinf.bundles import require_device
    from batchinf.controller import drive
    from batchinf.ledger.states import JobStatus
    from batchinf.ledger.status import status
    from batchinf.submit import submit
    from batchinf.manifest import load_manifest

    require_device(device)      # refused up front, not after workers failed their attempts
    job_id, created = submit(load_manifest(manifest), tenant=tenant)
    if not created and not as_json:
        console.print(f"resuming {job_id}", highlight=False)
    with progress(as_json) as bar:
        tick = ticker(bar, job_id)
        try:
            final = drive(job_id, workers=workers, device=device, threads=threads, on_tick=tick)
        except KeyboardInterrupt:
            bar.stop()
            console.print(f"interrupted; committed shards are kept. Run `batchinf run {manifest}` "
                          "again to resume.", highlight=False)
            sys.exit(130)
    s = status(job_id)
    emit(s, as_json, print_status)
    sys.exit(0 if final == JobStatus.SUCCEEDED else 1)


@click.command("submit")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False))
@click.option("--wait", is_flag=True, help="Wait for the job to finish, with a progress bar.")
@json_option
@tenant_option
@friendly
def submit(manifest: str, wait: bool, as_json: bool, tenant: str) -> None:
    """Submit a job to the ledger; a controller and workers run it (distributed mode).
    With --wait, exits 0 only if the job succeeded."""
    import time

    from batchinf.ledger.status import status
    from batchinf.submit import submit as do_submit
    from batchinf.ledger.states import JOB_TERMINAL, JobStatus
    from batchinf.manifest import load_manifest

    job_id, _ = do_submit(load_manifest(manifest), tenant=tenant)
    s = status(job_id)
    from batchinf.config import settings

    if wait and settings().embedded and not as_json:
        click.echo(f"{job_id} submitted to the embedded ledger; `batchinf serve` runs it (start it if it is "
                   f"not running, or use `batchinf run {manifest}`)", err=True)
    if wait:
        with progress(as_json) as bar:
            tick = ticker(bar, job_id)
            while (s := tick())["status"] not in JOB_TERMINAL:
                time.sleep(1.0)
    emit(s, as_json, print_status)
    if wait:
        sys.exit(0 if s["status"] == JobStatus.SUCCEEDED else 1)


@click.command("status")
@click.argument("job_id")
@json_option
@tenant_filter
@friendly
def status(job_id: str, as_json: bool, tenant: str | None) -> None:
    """Show one job's status (the same object as GET /v1/jobs/ID)."""
    from batchinf.ledger.status import status as job_status

    emit(job_status(job_id, tenant=tenant), as_json, print_status)


@click.command("cancel")
@click.argument("job_id")
@json_option
@tenant_filter
@friendly
def cancel(job_id: str, as_json: bool, tenant: str | None) -> None:
    """Cancel a job: dispatch stops, running attempts stop within a heartbeat, committed results
    stay and `_PARTIAL.json` describes what is done. `_SUCCESS` is never written."""
    from batchinf.controller import cancel as do_cancel
    from batchinf.ledger.status import status as job_status

    job_status(job_id, tenant=tenant)
    do_cancel(job_id)
    emit(job_status(job_id), as_json, print_status)


@click.command("jobs")
@click.option("--limit", default=50, show_default=True)
@click.option("--status", "status_is", type=click.Choice([s.value for s in JobStatus]), default=None,
              help="Only jobs in this state.")
@click.option("--name", default=None, help="Only jobs with this manifest name.")
@click.option("--schedule", default=None, help="Only jobs made by this schedule.")
@json_option
@tenant_filter
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
        stdout_console().print(t)

    emit(list_jobs(limit, tenant=tenant, status_is=status_is, name=name, schedule=schedule), as_json, human)


@click.command("verify")
@click.argument("job_or_uri")
@json_option
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
    def human(r: dict[str, Any]) -> None:
        if r["ok"]:
            counts = r["counts"]
            said = ", ".join(f"{v} {k}" for k, v in counts.items()) if isinstance(counts, dict) else str(counts)
            stdout_console().print(f"[green]ok[/green] {r['output_uri']}: {r['parts']} parts, {said}", highlight=False)
        else:   # the result is the mismatch: on stdout too (errors of batchinf itself go to stderr)
            stdout_console().print(f"[red]mismatch[/red] {r['output_uri']}: {r['error']}", highlight=False)

    emit(report, as_json, human)
    sys.exit(0 if report["ok"] else 1)


COMMANDS = [run, submit, status, cancel, jobs, verify]
