"""OpenAI-compatible Files and Batches: the service behind /v1/files, /v1/batches and the `files` /
`batches` commands. A batch is a batchinf job underneath (same ledger, same exactly-once
guarantee): its input is an uploaded file, its output the job's `openai/` lines, split into an
output file (successes) and an error file (failures, and `batch_cancelled` / `batch_expired`
lines for requests that never ran), so every custom_id appears exactly once across the two.

Files live in the object store under the tenant's own space, `<BATCHINF_FILES_URI>/<tenant>/`.
An upload is streamed to a temporary file (at most BATCHINF_MAX_FILE_BYTES), every line must be a
JSON object, and what the lines say (custom_ids, urls, models) is summarised in the file's row;
creating a batch checks that summary as OpenAI's validation does (one endpoint, one model that
exists, unique custom_ids) and fails the batch with `errors` otherwise. The model a line names is a
bundle (NAME, NAME@ALIAS, sha256:...), or an OpenAI model name the operator maps to one with
BATCHINF_OPENAI_MODELS; it is resolved once, when the batch is created, and pinned.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from typing import Any, BinaryIO, Iterator

from batchinf.bundles import get_info, resolve_ref
from batchinf.config import settings
from batchinf.errors import BundleError, InputError, LedgerError, ManifestError, NotFoundError
from batchinf.openai.lines import ENDPOINT_TASK
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import openai_files as repo
from batchinf.ledger.events import now
from batchinf.ledger.states import JobStatus
from batchinf.ledger.status import status as job_status
from batchinf.manifest import parse_duration, parse_manifest
from batchinf.openai.output import NOT_RUN_MESSAGES
from batchinf.store import get_store, join
from batchinf.scopes import Caller
from batchinf.submit import submit

PURPOSE_INPUT, PURPOSE_OUTPUT = "batch", "batch_output"
MAX_PROBLEMS = 20
CHUNK = 1 << 20

# batchinf job status -> OpenAI batch status
BATCH_STATUS = {
    JobStatus.SUBMITTED: "validating", JobStatus.PLANNING: "validating", JobStatus.PLANNED: "validating",
    JobStatus.RUNNING: "in_progress",
    JobStatus.VERIFYING: "finalizing", JobStatus.SUCCEEDED: "completed", JobStatus.FAILED: "failed",
    JobStatus.EXPIRED: "expired", JobStatus.CANCELLING: "cancelling", JobStatus.CANCELLED: "cancelled",
}
FINISHED = {JobStatus.SUCCEEDED, JobStatus.CANCELLED, JobStatus.EXPIRED, JobStatus.FAILED}


def tenant_root(tenant: str) -> str:
    return join(settings().files_uri, tenant)


# --- files --------------------------------------------------------------------------------------


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": int(row["bytes"]), "created_at": int(row["created_at"]),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None, "expires_at": None}


def _scan(path: str) -> dict[str, Any]:
    """Line-by-line check of an uploaded batch file: every non-blank line a JSON object (else
    InputError naming the line); the rest is summarised for batch creation to judge."""
    lines, problems, count = 0, [], 0
    models: dict[str, int] = {}
    urls: dict[str, int] = {}
    seen: set[str] = set()

    def problem(code: str, line: int, message: str, param: str | None = None) -> None:
        nonlocal count
        count += 1
        if len(problems) < MAX_PROBLEMS:
            problems.append({"code": code, "line": line, "message": message, "param": param})

    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise InputError(f"line {n} is not valid JSON ({exc}); each line of a batch file is one "
                                 "JSON request object", line=n) from None
            if not isinstance(obj, dict):
                raise InputError(f"line {n} is a JSON {type(obj).__name__}, not an object; each line of a "
                                 "batch file is one request object", line=n)
            lines += 1
            cid = obj.get("custom_id")
            if not isinstance(cid, str) or not cid:
                problem("missing_required_parameter", n, "custom_id is missing or not a string", "custom_id")
            elif cid in seen:
                problem("duplicate_custom_id", n, f"custom_id {cid!r} appears on an earlier line; "
                        "custom_ids must be unique in a batch", "custom_id")
            else:
                seen.add(cid)
            if obj.get("method") != "POST":
                problem("invalid_method", n, f"method {obj.get('method')!r} is not supported; use POST", "method")
            url = obj.get("url")
            urls.setdefault(str(url), n)
            body = obj.get("body")
            model = body.get("model") if isinstance(body, dict) else None
            if not isinstance(body, dict):
                problem("invalid_request", n, "body must be a JSON object", "body")
            elif not isinstance(model, str) or not model:
                problem("missing_required_parameter", n, "body.model is missing; name a bundle "
                        "(NAME, NAME@ALIAS or sha256:...)", "body.model")
            else:
                models.setdefault(model, n)
    if not lines:
        raise InputError("the file holds no request lines", param="file")
    return {"lines": lines, "models": models, "urls": urls, "problems": problems, "problem_count": count}


def upload_file(tenant: str, filename: str, purpose: str, fh: BinaryIO) -> dict[str, Any]:
    """Store an uploaded batch input file under the tenant's space; returns the file object."""
    if purpose != PURPOSE_INPUT:
        raise InputError(f"purpose {purpose!r} is not supported; batchinf stores files with purpose 'batch'",
                         param="purpose")
    limit = settings().max_file_bytes
    fd, tmp = tempfile.mkstemp(suffix=".jsonl")
    try:
        size = 0
        with os.fdopen(fd, "wb") as out:
            while chunk := fh.read(CHUNK):
                size += len(chunk)
                if size > limit:
                    raise InputError(f"the file is over {limit} bytes (BATCHINF_MAX_FILE_BYTES); split it",
                                     param="file")
                out.write(chunk)
        meta = _scan(tmp)
        file_id = "file-" + secrets.token_hex(12)
        uri = join(tenant_root(tenant), "files", f"{file_id}.jsonl")
        get_store(uri).put_file(uri, tmp)
    finally:
        os.unlink(tmp)
    row = {"id": file_id, "tenant": tenant, "filename": (filename or "upload.jsonl")[:300], "purpose": purpose,
           "bytes": size, "uri": uri, "meta": json.dumps(meta), "created_at": now()}
    repo.add_file(row)
    return file_object(row)


def _file_row(tenant: str, file_id: str) -> dict[str, Any]:
    row = repo.get_file(file_id, tenant)
    if row is None:
        raise NotFoundError(f"no file {file_id!r}", param="file_id")
    return row


def get_file(tenant: str, file_id: str) -> dict[str, Any]:
    return file_object(_file_row(tenant, file_id))


def list_files(tenant: str, *, purpose: str | None = None, after: str | None = None,
               limit: int = 10000) -> list[dict[str, Any]]:
    return [file_object(r) for r in repo.list_files(tenant, purpose=purpose, after=after, limit=limit)]


def delete_file(tenant: str, file_id: str) -> dict[str, Any]:
    row = _file_row(tenant, file_id)
    repo.delete_file(file_id, tenant)
    if row["uri"]:
        get_store(row["uri"]).delete(row["uri"])
    return {"id": file_id, "object": "file", "deleted": True}


def _file_uris(row: dict[str, Any]) -> list[str]:
    return [row["uri"]] if row["uri"] else json.loads(row["parts"] or "[]")


def file_content(tenant: str, file_id: str) -> Iterator[bytes]:
    """The file's bytes, streamed (a batch output file: its parts one after another)."""
    uris = _file_uris(_file_row(tenant, file_id))

    def chunks() -> Iterator[bytes]:
        for uri in uris:
            store = get_store(uri)
            with store.open_read(store.head(uri)) as f:
                while chunk := f.read(CHUNK):
                    yield chunk
    return chunks()


# --- batches ------------------------------------------------------------------------------------


def model_map() -> dict[str, str]:
    """BATCHINF_OPENAI_MODELS: OpenAI model name -> bundle reference."""
    pairs = (p.split("=", 1) for p in settings().openai_models.split(",") if "=" in p)
    return {k.strip(): v.strip() for k, v in pairs}


def _validate(meta: dict[str, Any], endpoint: str) -> tuple[list[dict[str, Any]], str | None, str | None]:
    """OpenAI's batch validation over the upload's summary: (errors, bundle ref, digest)."""
    errors = list(meta["problems"])
    for url, line in meta["urls"].items():
        if url != endpoint:
            errors.append({"code": "invalid_url", "line": line, "param": "url",
                           "message": f"url {url!r} does not match the batch's endpoint {endpoint}"})
    models = meta["models"]
    ref = digest = None
    if len(models) > 1:
        (first, _), (other, line) = sorted(models.items(), key=lambda kv: kv[1])[:2]
        errors.append({"code": "mismatched_model", "line": line, "param": "body.model",
                       "message": f"model {other!r} differs from {first!r} on an earlier line; all lines of "
                                  "a batch must name the same model"})
    elif models:
        (model, line), = models.items()
        ref = model_map().get(model, model)
        try:
            digest = resolve_ref(ref)
            task = get_info(digest).task
            if task != ENDPOINT_TASK.get(endpoint):
                errors.append({"code": "invalid_model", "line": line, "param": "body.model",
                               "message": f"model {model!r} is a {task} bundle; it cannot serve {endpoint}"})
        except BundleError:
            errors.append({"code": "model_not_found", "line": line, "param": "body.model",
                           "message": f"The model `{model}` does not exist: no bundle {ref!r} is imported "
                                      "(see `batchinf bundle list`, or map the name with BATCHINF_OPENAI_MODELS)"})
    return errors, ref, digest


def create_batch(tenant: str, input_file_id: str, endpoint: str, completion_window: str = "24h",
                 metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """Create a batch: validate its input file, resolve and pin the model, submit its job."""
    if endpoint not in ENDPOINT_TASK:
        raise InputError(f"endpoint {endpoint!r} is not supported; use one of {', '.join(ENDPOINT_TASK)}",
                         param="endpoint")
    try:
        window = parse_duration(completion_window, "completion_window")
    except ManifestError as exc:
        raise ManifestError(str(exc), param="completion_window") from None
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items())):
        raise InputError("metadata holds at most 16 string keys (64 chars) with string values (512 chars)",
                         param="metadata")
    f = _file_row(tenant, input_file_id)
    if f["purpose"] != PURPOSE_INPUT:
        raise InputError(f"file {input_file_id} has purpose {f['purpose']!r}; a batch needs a 'batch' file",
                         param="input_file_id")
    errors, ref, digest = _validate(json.loads(f["meta"]), endpoint)
    batch_id = "batch_" + secrets.token_hex(12)
    t = now()
    row = {"id": batch_id, "tenant": tenant, "input_file_id": input_file_id, "endpoint": endpoint,
           "completion_window": completion_window, "model": ref, "created_at": t,
           "metadata": json.dumps(metadata) if metadata is not None else None}
    if errors:
        repo.add_batch({**row, "errors": json.dumps(errors), "failed_at": t})
        return batch_object(repo.get_batch(batch_id, tenant) or row)
    manifest = parse_manifest({
        "name": batch_id, "task": ENDPOINT_TASK[endpoint], "bundle": digest if ref is None else ref,
        "input": {"uri": f["uri"], "format": "openai-batch"},
        "output": {"uri": join(tenant_root(tenant), "batches", batch_id) + "/"},
        "shards": {"max_records": settings().openai_shard_records},
        "deadline": f"{window}s", "idempotency_key": batch_id})
    job_id, _ = submit(manifest, Caller(tenant))     # confined: a batch reads and writes only the tenant's space
    repo.add_batch({**row, "job_id": job_id})
    return get_batch(tenant, batch_id)


def _batch_row(tenant: str, batch_id: str) -> dict[str, Any]:
    row = repo.get_batch(batch_id, tenant)
    if row is None:
        raise NotFoundError(f"no batch {batch_id!r}", param="batch_id")
    return row


def get_batch(tenant: str, batch_id: str) -> dict[str, Any]:
    return batch_object(_batch_row(tenant, batch_id))


def list_batches(tenant: str, *, after: str | None = None, limit: int = 20) -> dict[str, Any]:
    """OpenAI's list envelope, newest first."""
    rows, more = repo.page_batches(tenant, after=after, limit=limit)
    data = [batch_object(r) for r in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def cancel_batch(tenant: str, batch_id: str) -> tuple[dict[str, Any], str]:
    """Ask the batch's job to stop (its driver finishes it: committed answers stay, the rest get
    batch_cancelled lines); returns (batch object, job id). LedgerError when it has finished."""
    row = _batch_row(tenant, batch_id)
    if row["job_id"] is None:
        raise LedgerError(f"batch {batch_id} is failed; nothing to cancel")
    if not job_repo.request_cancel(row["job_id"], "cancelled by request"):
        st = job_repo.get(row["job_id"]).status
        if st != JobStatus.CANCELLING:
            raise LedgerError(f"batch {batch_id} is {BATCH_STATUS[JobStatus(st)]}; nothing to cancel")
    if row["cancelling_at"] is None:
        repo.update_batch(batch_id, cancelling_at=now())
    return get_batch(tenant, batch_id), row["job_id"]


def _output_file(row: dict[str, Any], which: str, uris: list[str], t: float) -> dict[str, Any] | None:
    if not uris:
        return None
    store = get_store(uris[0])
    size = sum(store.head(u).size for u in uris)
    fid = "file-" + hashlib.sha256(f"{row['id']}|{which}".encode()).hexdigest()[:24]
    return {"id": fid, "tenant": row["tenant"], "filename": f"{row['id']}_{which}.jsonl", "purpose": PURPOSE_OUTPUT,
            "bytes": size, "uri": None, "parts": json.dumps(uris), "created_at": t}


def _not_run_from_input(row: dict[str, Any], out: str, code: str) -> list[str]:
    """A job stopped before it was planned has no shards: every request of the input file gets
    its `code` line here instead."""
    f = repo.get_file(row["input_file_id"], row["tenant"])
    if f is None or not f["uri"]:
        return []
    lines = []
    for raw in get_store(f["uri"]).get_bytes(f["uri"]).splitlines():
        if raw.strip():
            cid = json.loads(raw).get("custom_id")
            h = hashlib.sha256(f"{row['id']}\0{cid}\0{len(lines)}".encode()).hexdigest()
            lines.append(json.dumps({"id": f"batch_req_{h[:32]}", "custom_id": cid, "response": None,
                                     "error": {"code": code, "message": NOT_RUN_MESSAGES[code]}}))
    uri = join(out, "openai", "not-run-unplanned.jsonl")
    get_store(uri).put_bytes(uri, ("\n".join(lines) + "\n").encode())
    return [uri]


def _finalize(row: dict[str, Any], st: JobStatus, out: str) -> dict[str, Any]:
    """Record a finished job's output and error files (once)."""
    files: dict[str, list[str]] = {"output": [], "error": []}
    if st != JobStatus.FAILED:
        store = get_store(out)
        name = "_MANIFEST.json" if st == JobStatus.SUCCEEDED else "_PARTIAL.json"
        manifest = json.loads(store.get_bytes(join(out, name)))
        kinds = {p["key"]: p["kind"] for p in manifest["parts"]}
        for p in manifest["parts"]:
            if p["kind"] == "openai":
                which = "output" if kinds.get(p["from"]) == "results" else "error"
                files[which].append(join(out, p["key"]))
        if st != JobStatus.SUCCEEDED and manifest["counts"]["records_total"] is None:
            files["error"] += _not_run_from_input(row, out, "batch_expired" if st == JobStatus.EXPIRED
                                                  else "batch_cancelled")
    t = now()
    repo.finalize_batch(row["id"], _output_file(row, "output", files["output"], t),
                        _output_file(row, "error", files["error"], t))
    return repo.get_batch(row["id"], row["tenant"]) or row


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI batch object of a batch row, from its job's status."""
    created = row["created_at"]
    window = parse_duration(row["completion_window"], "completion_window")
    obj: dict[str, Any] = {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"], "model": row["model"], "errors": None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": "failed", "output_file_id": None, "error_file_id": None, "created_at": int(created),
        "in_progress_at": None, "expires_at": int(created + window), "finalizing_at": None,
        "completed_at": None, "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None, "usage": None}
    if row["job_id"] is None:
        obj["errors"] = {"object": "list", "data": json.loads(row["errors"] or "[]")}
        obj["failed_at"] = int(row["failed_at"] or created)
        return obj
    s = job_status(row["job_id"])
    st = JobStatus(s["status"])
    if st in FINISHED and row["finalized_at"] is None:
        row = _finalize(row, st, s["output_uri"])
    at = repo.entered_at(row["job_id"])
    status = BATCH_STATUS[st]
    if st == JobStatus.CANCELLING and row["cancelling_at"] is None:
        status = "in_progress"        # stopping at its deadline: it ends expired
    c = s["counts"]
    total = c["records_total"] if c["records_total"] is not None else json.loads(
        (repo.get_file(row["input_file_id"], row["tenant"]) or {}).get("meta") or '{"lines": 0}')["lines"]
    out_tokens = repo.output_tokens(row["job_id"])

    def ts(status_: JobStatus) -> int | None:
        return int(at[status_.value]) if status_.value in at else None

    obj.update(
        status=status, output_file_id=row["output_file_id"], error_file_id=row["error_file_id"],
        in_progress_at=ts(JobStatus.RUNNING), finalizing_at=ts(JobStatus.VERIFYING),
        completed_at=ts(JobStatus.SUCCEEDED), failed_at=ts(JobStatus.FAILED), expired_at=ts(JobStatus.EXPIRED),
        cancelling_at=int(row["cancelling_at"]) if row["cancelling_at"] else None,
        cancelled_at=ts(JobStatus.CANCELLED),
        request_counts={"total": total or 0, "completed": c["records_succeeded"], "failed": c["records_failed"]},
        usage={"input_tokens": s["tokens"]["input"], "output_tokens": out_tokens,
               "total_tokens": s["tokens"]["input"] + out_tokens,
               "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
        job_id=row["job_id"])
    if st == JobStatus.FAILED:
        obj["errors"] = {"object": "list", "data": [{"code": "job_failed", "message": s["error"],
                                                     "param": None, "line": None}]}
    return obj
