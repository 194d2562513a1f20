"""Submitting jobs, pinning their inputs, and the one status model every surface reads."""

from __future__ import annotations

import json
import secrets
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.exc import IntegrityError

from batchinf.bundles import get_info, resolve_ref
from batchinf.errors import InputError, LedgerError, ManifestError
from batchinf.ledger.db import tx
from batchinf.ledger.ops import now, shard_counts
from batchinf.ledger.states import JOB_ACTIVE, ShardStatus
from batchinf.ledger.tables import job_inputs, jobs, shards
from batchinf.manifest import JobManifest, manifest_from_dict
from batchinf.store import ObjectPin, get_store, join, normalize_uri


def submit(manifest: JobManifest, *, tenant: str = "default", schedule: str | None = None) -> tuple[str, bool]:
    """Create the job, or return the existing one for the same idempotency key.

    Returns (job_id, created). The bundle reference is resolved to a digest here, once: moving an
    alias later never changes what this job runs."""
    key = manifest.idempotency_key or manifest.content_key()
    existing = find_by_key(tenant, key)
    if existing:
        return existing, False
    digest = resolve_ref(manifest.bundle)
    bundle_task = get_info(digest).task
    if bundle_task != manifest.task:
        raise ManifestError(f"bundle {manifest.bundle} is a {bundle_task} model and this job's task is "
                            f"{manifest.task}; choose a {manifest.task} bundle or set task: {bundle_task}")
    input_uri = normalize_uri(manifest.input.uri or manifest.input.manifest or "")
    output_uri = normalize_uri(manifest.output_uri).rstrip("/") + "/"
    _check_output_free(output_uri)
    t = now()
    job_id = "job-" + secrets.token_hex(8)
    try:
        with tx() as conn:
            conn.execute(insert(jobs).values(
                id=job_id, tenant=tenant, name=manifest.name, idempotency_key=key, status="submitted",
                task=manifest.task, manifest=json.dumps(manifest.to_dict()), bundle_ref=manifest.bundle,
                bundle_digest=digest, input_uri=input_uri, output_uri=output_uri,
                work_uri=join(output_uri, "_work", job_id) + "/", priority=manifest.priority,
                deadline_at=(t + manifest.deadline_seconds) if manifest.deadline_seconds else None,
                schedule=schedule, created_at=t, updated_at=t))
    except IntegrityError:
        existing = find_by_key(tenant, key)
        if existing:
            return existing, False
        raise
    return job_id, True


def _check_output_free(output_uri: str) -> None:
    """Two jobs never share an output prefix: their parts would mix."""
    with tx() as conn:
        other = conn.execute(select(jobs.c.id).where(jobs.c.output_uri == output_uri,
                                                     jobs.c.status.in_([s.value for s in JOB_ACTIVE]))
                             ).scalar()
    if other:
        raise ManifestError(f"output {output_uri} is in use by active job {other}; choose another "
                            "output.uri or cancel that job")
    if get_store(output_uri).exists(join(output_uri, "_SUCCESS")):
        raise ManifestError(f"output {output_uri} already holds a published job (_SUCCESS exists); "
                            "choose a new output.uri or delete the old output first")


def find_by_key(tenant: str, key: str) -> str | None:
    with tx() as conn:
        return conn.execute(select(jobs.c.id).where(jobs.c.tenant == tenant,
                                                    jobs.c.idempotency_key == key)).scalar()


def job_row(job_id: str) -> Any:
    with tx() as conn:
        row = conn.execute(select(jobs).where(jobs.c.id == job_id)).first()
    if row is None:
        raise LedgerError(f"no job {job_id!r}; see `batchinf jobs`")
    return row


def job_manifest(row: Any) -> JobManifest:
    return manifest_from_dict(json.loads(row.manifest))


def pin_inputs(manifest: JobManifest) -> list[ObjectPin]:
    """List the input once and pin key, size, ETag and version of every object it will read."""
    spec = manifest.input
    if spec.uri:
        uri = normalize_uri(spec.uri)
        pins = get_store(uri).list(uri)
        if not pins:
            raise InputError(f"input {uri} has no objects; check input.uri (a prefix ends with /)")
        return pins
    return _pins_from_input_manifest(normalize_uri(spec.manifest or ""))


def _pins_from_input_manifest(uri: str) -> list[ObjectPin]:
    """A JSONL list of objects: {"uri": ...} or S3 Inventory style {"bucket", "key"}, each with an
    optional "version_id" (or "VersionId")."""
    pins = []
    for n, line in enumerate(get_store(uri).get_bytes(uri).decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if "uri" in entry:
                obj = normalize_uri(entry["uri"])
            else:
                bucket = entry.get("bucket") or entry["Bucket"]
                obj = f"s3://{bucket}/{entry.get('key') or entry['Key']}"
            version = entry.get("version_id") or entry.get("VersionId")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"input manifest {uri} line {n}: expected a JSON object with uri, or "
                                f"bucket and key, and optional version_id ({exc})") from exc
        pins.append(get_store(obj).head(obj, version_id=version))
    if not pins:
        raise InputError(f"input manifest {uri} lists no objects")
    return pins


def input_pins(job_id: str) -> list[tuple[ObjectPin, int | None]]:
    with tx() as conn:
        rows = conn.execute(select(job_inputs).where(job_inputs.c.job_id == job_id)
                            .order_by(job_inputs.c.idx)).all()
    return [(ObjectPin(uri=r.uri, size=r.size, etag=r.etag, version_id=r.version_id), r.records)
            for r in rows]


def status(job_id: str) -> dict[str, Any]:
    """The status object of `run/submit/status --json` and the REST API."""
    row = job_row(job_id)
    with tx() as conn:
        counts = shard_counts(conn, job_id)
        ok, failed, done = conn.execute(
            select(*(func.coalesce(func.sum(c), 0) for c in (shards.c.output_rows, shards.c.error_rows,
                                                              shards.c.num_records)))
            .where(shards.c.job_id == job_id, shards.c.status == ShardStatus.COMMITTED.value)).one()
    total = sum(counts.values())
    return {
        "job_id": row.id, "name": row.name, "status": row.status, "tenant": row.tenant,
        "task": row.task, "output_uri": row.output_uri, "input_uri": row.input_uri,
        "bundle": row.bundle_ref, "bundle_digest": row.bundle_digest,
        "shards": {"total": total,
                   "committed": counts.get("committed", 0),
                   "running": counts.get("running", 0),
                   "pending": sum(counts.get(s, 0) for s in ("pending", "queued", "retrying")),
                   "quarantined": counts.get("quarantined", 0),
                   "failed": counts.get("failed", 0)},
        "counts": {"records_total": row.records_total,
                   "records_done": int(done),
                   "records_succeeded": int(ok),
                   "records_failed": int(failed)},
        "error": row.error, "created_at": row.created_at, "finished_at": row.finished_at,
    }


def list_jobs(limit: int = 50) -> list[dict[str, Any]]:
    with tx() as conn:
        ids = conn.execute(select(jobs.c.id).order_by(jobs.c.created_at.desc()).limit(limit)).scalars().all()
    return [status(i) for i in ids]
