"""OpenAI-compatible files and batches from the command line, over the ledger directly (the same
service as /v1/files and /v1/batches): `files upload|list|show|download|delete`,
`batches create|list|show|cancel`."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from batchinf.cli.common import emit, friendly, json_option, tenant_option


@click.group("files")
def files() -> None:
    """Batch input files and batch output files (OpenAI's /v1/files)."""


def _print_file(f: dict[str, Any]) -> None:
    click.echo(f"{f['id']}  {f['purpose']}  {f['bytes']} bytes  {f['filename']}")


@files.command("upload")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--purpose", default="batch", show_default=True)
@tenant_option
@json_option
@friendly
def files_upload(path: str, purpose: str, tenant: str, as_json: bool) -> None:
    """Upload a JSONL batch input file (checked line by line); prints its file id."""
    from pathlib import Path

    from batchinf.openai.batches import upload_file

    with open(path, "rb") as fh:
        emit(upload_file(tenant, Path(path).name, purpose, fh), as_json, _print_file)


@files.command("list")
@click.option("--purpose", default=None)
@tenant_option
@json_option
@friendly
def files_list(purpose: str | None, tenant: str, as_json: bool) -> None:
    """This tenant's files, newest first."""
    from batchinf.openai.batches import list_files

    emit(list_files(tenant, purpose=purpose), as_json, lambda rows: [_print_file(f) for f in rows])


@files.command("show")
@click.argument("file_id")
@tenant_option
@json_option
@friendly
def files_show(file_id: str, tenant: str, as_json: bool) -> None:
    """One file object."""
    from batchinf.openai.batches import get_file

    emit(get_file(tenant, file_id), as_json, _print_file)


@files.command("download")
@click.argument("file_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help="Default: stdout.")
@tenant_option
@json_option
@friendly
def files_download(file_id: str, output: str | None, tenant: str, as_json: bool) -> None:
    """Write a file's content (e.g. a batch's output or error file) to stdout or --output (with
    --json: to --output, printing {id, output, bytes})."""
    from batchinf.openai.batches import file_content

    chunks = file_content(tenant, file_id)
    if output is None:
        if as_json:
            raise click.UsageError("--json needs --output FILE (the content goes there)")
        for chunk in chunks:
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        return
    size = 0
    with open(output, "wb") as out:
        for chunk in chunks:
            out.write(chunk)
            size += len(chunk)
    emit({"id": file_id, "output": output, "bytes": size}, as_json, lambda r: None)


@files.command("delete")
@click.argument("file_id")
@tenant_option
@json_option
@friendly
def files_delete(file_id: str, tenant: str, as_json: bool) -> None:
    """Delete a file (its object too)."""
    from batchinf.openai.batches import delete_file

    emit(delete_file(tenant, file_id), as_json, lambda r: click.echo(f"{r['id']} deleted"))


@click.group("batches")
def batches() -> None:
    """OpenAI-style batches (a batchinf job each; `batchinf serve` runs them on the embedded ledger)."""


def _print_batch(b: dict[str, Any]) -> None:
    c = b["request_counts"]
    click.echo(f"{b['id']}  {b['status']}  {b['endpoint']}  {c['completed']}/{c['total']} completed, "
               f"{c['failed']} failed  output {b['output_file_id'] or '-'}  errors {b['error_file_id'] or '-'}")
    for e in (b.get("errors") or {}).get("data", []):
        click.echo(f"  line {e.get('line')}: {e['code']}: {e['message']}")


@batches.command("create")
@click.option("--input-file-id", required=True)
@click.option("--endpoint", required=True, type=click.Choice(["/v1/chat/completions", "/v1/completions",
                                                               "/v1/embeddings"]))
@click.option("--completion-window", default="24h", show_default=True)
@click.option("--metadata", default=None, help='JSON object of strings, e.g. \'{"team": "search"}\'.')
@tenant_option
@json_option
@friendly
def batches_create(input_file_id: str, endpoint: str, completion_window: str, metadata: str | None,
                   tenant: str, as_json: bool) -> None:
    """Create a batch from an uploaded file."""
    from batchinf.openai.batches import create_batch

    meta = json.loads(metadata) if metadata else None
    emit(create_batch(tenant, input_file_id, endpoint, completion_window, meta), as_json, _print_batch)


@batches.command("list")
@click.option("--limit", default=20, show_default=True)
@click.option("--after", default=None)
@tenant_option
@json_option
@friendly
def batches_list(limit: int, after: str | None, tenant: str, as_json: bool) -> None:
    """This tenant's batches, newest first."""
    from batchinf.openai.batches import list_batches

    emit(list_batches(tenant, after=after, limit=limit), as_json, lambda page: [_print_batch(b) for b in page["data"]])


@batches.command("show")
@click.argument("batch_id")
@tenant_option
@json_option
@friendly
def batches_show(batch_id: str, tenant: str, as_json: bool) -> None:
    """One batch object (status, counts, output and error file ids)."""
    from batchinf.openai.batches import get_batch

    emit(get_batch(tenant, batch_id), as_json, _print_batch)


@batches.command("cancel")
@click.argument("batch_id")
@tenant_option
@json_option
@friendly
def batches_cancel(batch_id: str, tenant: str, as_json: bool) -> None:
    """Cancel a batch: answers so far stay; requests not run get batch_cancelled lines."""
    from batchinf.controller import cancel
    from batchinf.openai.batches import cancel_batch, get_batch

    _, job_id = cancel_batch(tenant, batch_id)
    cancel(job_id)       # finishes it here when no worker holds a lease; else its driver does
    emit(get_batch(tenant, batch_id), as_json, _print_batch)


COMMANDS = [files, batches]
