"""Job commands: `run` (embedded mode), `submit`, `plan` (a dry run) and `start`, `retry`, `status`,
`cancel`, `jobs`, `verify`."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from batchinf.cli.common import (console, emit, friendly, json_option, print_status, progress, stdout_console,
                                 tenant_filter, tenant_option, ticker)
from batchinf.ledger.states import JobStatus

if TYPE_CHECKING:
    from batchinf.ledger.models import Job


@click.command("run")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False))
@click.option("--workers", type=int, default=None,
              help="Local worker processes (default: one per core, one thread each; a generate job on "
                   "the CPU: one process with a lane per core).")
@click.option("--lanes", type=int, default=None,
              help="Shards each worker process runs at once, a thread each, sharing its loaded model.")
@click.option("--threads", type=int, default=None,
              help="Torch threads per lane (default: cores / (workers x lanes)).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@json_option
@tenant_option
@friendly
def run(manifest: str, workers: int | None, lanes: int | None, threads: int | None, device: str, as_json: bool,
        tenant: str) -> None:
    """Run a job to completion on this machine (embedded mode). Re-running the same manifest
    resumes the same job from the ledger. Exits 0 only when the job succeeded."""
    from batchinf.bundles import require_device
    from batchinf.controller import drive
    from batchinf.lanes import local_layout
    from batchinf.ledger.jobs import get as job_row
    from batchinf.ledger.states import JobStatus
    from batchinf.ledger.status import status
    from batchinf.manifest import load_manifest
    from batchinf.scopes import Caller
    from batchinf.submit import submit

    from batchinf.phases import process_started_at

    require_device(device)      # refused up front, not after workers failed their attempts
    job_id, created = submit(load_manifest(manifest), Caller(tenant, operator=True),
                             process_started_at=process_started_at())
    job = job_row(job_id)
    if not created and finished_hint(job):
        emit(status(job_id), as_json, print_status)
        sys.exit(0 if status(job_id)["status"] == JobStatus.SUCCEEDED else 1)
    if not created and not as_json:
        said = "running the job `batchinf plan` planned:" if job.status == JobStatus.PLANNED else "resuming"
        console.print(f"{said} {job_id}", highlight=False)
    with progress(as_json) as bar:
        tick = ticker(bar, job_id)
        try:
            processes, lanes, threads = local_layout(job, device, workers, lanes, threads)
            final = drive(job_id, workers=processes, lanes=lanes, device=device, threads=threads,
                          on_tick=None if bar.disable else tick)
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
    from batchinf.scopes import Caller

    from batchinf.phases import process_started_at

    job_id, created = do_submit(load_manifest(manifest), Caller(tenant, operator=True),
                                process_started_at=process_started_at())
    if not created:
        from batchinf.ledger.jobs import get as job_row, release

        job = job_row(job_id)
        if not finished_hint(job) and job.status == JobStatus.PLANNED:
            release(job_id)      # planned by `batchinf plan`: its shards run now
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


def finished_hint(job: Job) -> bool:
    """When a manifest's job has already finished, say so and how to get a new job; returns
    whether it had finished."""
    from batchinf.ledger.states import JOB_TERMINAL, JobStatus

    job_id = job.id
    if job.status not in JOB_TERMINAL:
        return False
    key = f"idempotency_key {job.idempotency_key!r}"
    if job.status == JobStatus.SUCCEEDED:
        console.print(f"{job_id} already succeeded under {key}; this manifest returns that job. To run it "
                      "again, set a new idempotency_key in the manifest (and a new output.uri).", highlight=False)
    else:
        why = f": {job.error}" if job.error else ""
        console.print(f"{job_id} already {job.status}{why}\nThis manifest ({key}) returns that job; "
                      f"nothing was resumed. To get a new job: `batchinf retry {job_id} --not-done` runs the "
                      "records that never finished (add --errors CODE,... for error rows) with the same inputs "
                      "and bundle into a new output; or set a new idempotency_key in the manifest to start over.",
                      highlight=False, soft_wrap=True)
    return True


@click.command("retry")
@click.argument("job_id")
@click.option("--errors", "codes", default=None, metavar="CODE,...",
              help="Run again the records with these error codes (all: every code).")
@click.option("--not-done", is_flag=True, help="Run again the records of shards that never finished.")
@click.option("--output", default=None, metavar="URI", help="The new job's output (default: the old one + -retry-N/).")
@click.option("--detach", is_flag=True, help="Only create the job (a controller runs it); default: run it here.")
@click.option("--workers", type=int, default=None, help="Local worker processes (default: as `batchinf run`).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@json_option
@tenant_filter
@friendly
def retry(job_id: str, codes: str | None, not_done: bool, output: str | None, detach: bool, workers: int | None,
          device: str, as_json: bool, tenant: str | None) -> None:
    """A new job over exactly the failed (--errors) and/or unfinished (--not-done) records of a
    finished, failed, cancelled or expired job: same pinned bundle and inputs, new output, lineage
    in both jobs' status (retry_of, retries). Exits 0 when the new job succeeded (or --detach)."""
    from batchinf.controller import drive
    from batchinf.lanes import local_layout
    from batchinf.ledger.states import JobStatus
    from batchinf.ledger.status import status as job_status
    from batchinf.ledger.jobs import get as get_job
    from batchinf.rerun import input_errors_note, rerun_job
    from batchinf.scopes import Caller

    errors = [c.strip() for c in codes.split(",") if c.strip()] if codes is not None else None
    old = get_job(job_id, tenant=tenant)
    rerun = rerun_job(old, Caller(old.tenant, operator=True), errors=errors, not_done=not_done, output=output)
    new_id = rerun.job_id
    if not as_json:
        console.print(f"{new_id} retries {job_id}", highlight=False)
        if (note := input_errors_note(rerun)):
            console.print(note, highlight=False)
    final = job_status(new_id)["status"]
    if not detach:
        with progress(as_json) as bar:
            processes, lanes, threads = local_layout(get_job(new_id), device, workers)
            final = drive(new_id, workers=processes, lanes=lanes, threads=threads, device=device,
                          on_tick=ticker(bar, new_id))
    emit(job_status(new_id), as_json, print_status)
    sys.exit(0 if detach or final == JobStatus.SUCCEEDED else 1)


@click.command("plan")
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False))
@click.option("--tokens-per-second", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Declared input tokens per worker-second of the bundle (transcribe: audio seconds per "
                   "worker-second; default: measured from its earlier jobs).")
@click.option("--workers", default=1, show_default=True,
              help="Workers the job's shards are sized for (see shards.target_workers) and the estimate assumes.")
@click.option("--processes", default=1, show_default=True, help="Local processes that plan input objects.")
@json_option
@tenant_option
@friendly
def plan(manifest: str, tokens_per_second: float | None, workers: int, processes: int, as_json: bool,
         tenant: str) -> None:
    """Dry run: pin and plan the job without executing it, and report records, invalid records,
    tokens per bucket, shards, padding efficiency and (with a throughput and
    BATCHINF_PRICE_PER_WORKER_HOUR) duration and cost. The job is held `planned`: `batchinf run`
    of the same manifest, or `batchinf start JOB`, runs its shards without planning again."""
    from batchinf.dryrun import plan_only, report
    from batchinf.manifest import load_manifest
    from batchinf.scopes import Caller

    job_id = plan_only(load_manifest(manifest), Caller(tenant, operator=True), processes=processes, workers=workers)
    r = report(job_id, tokens_per_second=tokens_per_second, workers=workers)
    emit(r, as_json, print_plan)
    sys.exit(0 if r["planned"] else 1)


def print_plan(r: dict[str, Any]) -> None:
    out = stdout_console()
    out.print(f"{r['job_id']}  {r['status']}", highlight=False)
    if not r["planned"]:
        out.print(f"not planned{': ' + r['error'] if r['error'] else ''}", highlight=False)
        return
    eff = r["padding_efficiency"]
    out.print(f"{r['records']} records in {r['objects']} objects, {r['invalid']} invalid "
              f"{r['invalid_by_code'] or ''}; {r['tokens']['total']} tokens; {r['shards']} shards; "
              f"padding efficiency {'–' if eff is None else f'{eff:.3f}'} (estimated)", highlight=False)
    if "audio_hours" in r:      # transcribe: its tokens are seconds of audio
        out.print(f"{r['audio_hours']:.3f} hours of audio", highlight=False)
    t = Table("bucket", "max tokens", "records", "tokens")
    for b in r["tokens"]["per_bucket"]:
        t.add_row(str(b["bucket"]), str(b["max_tokens"]), str(b["records"]), str(b["tokens"]))
    out.print(t)
    e = r["estimate"]
    if e["worker_hours"] is None:
        out.print("no throughput known for this bundle: pass --tokens-per-second for an estimate", highlight=False)
    else:
        cost = "" if e["cost"] is None else f", cost {e['cost']:.4f} at {e['price_per_worker_hour']}/worker-hour"
        unit = "audio-seconds/s" if "audio_hours" in r else "tokens/s"     # transcribe's tokens are seconds
        out.print(f"{e['worker_hours']:.3f} worker-hours at {e['tokens_per_second']:.0f} {unit} "
                  f"({e['throughput_source']}): {e['duration_seconds']:.0f} s on {e['workers']} worker(s){cost}",
                  highlight=False)
    if r["next"]:
        out.print(f"run it: {r['next']}", highlight=False)


@click.command("start")
@click.argument("job_id")
@json_option
@tenant_filter
@friendly
def start(job_id: str, as_json: bool, tenant: str | None) -> None:
    """Start a job planned by `batchinf plan`: a controller runs its planned shards."""
    from batchinf.dryrun import start as do_start
    from batchinf.ledger.status import status as job_status

    do_start(job_id, tenant=tenant)
    emit(job_status(job_id), as_json, print_status)


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
    """Cancel a job: dispatch stops, running attempts stop at their next batch and commit what
    they finished, committed results stay and `_PARTIAL.json` describes what is done. `_SUCCESS`
    is never written."""
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
@click.option("--publish", "publish_again", is_flag=True,
              help="First verify and publish again JOB, whose shards are all committed: one still verifying, or "
                   "failed in verification or publishing (e.g. the store was down). It ends succeeded when it passes.")
@json_option
@friendly
def verify(job_or_uri: str, publish_again: bool, as_json: bool) -> None:
    """Re-check a published output (coverage, part digests, row counts). Non-zero exit on mismatch."""
    from batchinf.errors import VerificationError
    from batchinf.verify import verify_output

    uri, extra = job_or_uri, {}
    if publish_again and not job_or_uri.startswith("job-"):
        raise click.UsageError(f"--publish takes a job id (job-...), not {job_or_uri!r}")
    if job_or_uri.startswith("job-"):
        from batchinf.ledger.jobs import get as job_row

        if publish_again:
            from batchinf.controller import republish

            extra = {"job_id": job_or_uri, "status": republish(job_or_uri)}
        job = job_row(job_or_uri)
        uri = job.output_uri
    if extra and extra["status"] != JobStatus.SUCCEEDED:
        report = {"ok": False, "output_uri": uri, "error": job.error or f"job {job_or_uri} is {extra['status']}"}
    else:
        try:
            report = verify_output(uri)
        except VerificationError as exc:
            report = {"ok": False, "output_uri": uri, "error": str(exc)}
    report.update(extra)

    def human(r: dict[str, Any]) -> None:
        if "status" in r:
            stdout_console().print(f"job {r['job_id']}: {r['status']}", highlight=False)
        if r["ok"]:
            counts = r["counts"]
            said = ", ".join(f"{v} {k}" for k, v in counts.items()) if isinstance(counts, dict) else str(counts)
            stdout_console().print(f"[green]ok[/green] {r['output_uri']}: {r['parts']} parts, {said}", highlight=False)
        else:   # the result is the mismatch: on stdout too (errors of batchinf itself go to stderr)
            stdout_console().print(f"[red]mismatch[/red] {r['output_uri']}: {r['error']}", highlight=False)

    emit(report, as_json, human)
    sys.exit(0 if report["ok"] else 1)


COMMANDS = [run, submit, plan, start, retry, status, cancel, jobs, verify]
