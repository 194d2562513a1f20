"""Submit a job (bundle reference -> digest, idempotency) and pin its inputs."""

from __future__ import annotations

import json
import secrets

from batchinf.bundles import get_info, resolve_ref
from batchinf.errors import InputError, LedgerError, ManifestError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger.events import now
from batchinf.manifest import JobManifest
from batchinf.store import ObjectPin, get_store, join, normalize_uri


def submit(manifest: JobManifest, *, tenant: str = "default", schedule: str | None = None,
           retry_of: str | None = None, selection: list[tuple[str, int]] | None = None) -> tuple[str, bool]:
    """Create the job, or return the existing one for the same idempotency key (a different
    manifest under a used key is an IdempotencyConflict naming the fields that differ).

    Returns (job_id, created). The bundle reference is resolved to a digest here, once: moving an
    alias later never changes what this job runs. `retry_of`/`selection`: see retries.py."""
    key = manifest.idempotency_key or manifest.content_key()
    existing = job_repo.find_by_key(tenant, key)
    if existing:
        check_same_manifest(existing, key, manifest)
        return existing, False
    digest = resolve_ref(manifest.bundle)
    bundle_task = get_info(digest).task
    if bundle_task != manifest.task:
        raise ManifestError(f"bundle {manifest.bundle} is a {bundle_task} model and this job's task is "
                            f"{manifest.task}; choose a {manifest.task} bundle or set task: {bundle_task}")
    input_uri = normalize_uri(manifest.input.uri or manifest.input.manifest or "")
    output_uri = normalize_uri(manifest.output_uri).rstrip("/") + "/"
    _check_output_free(output_uri, tenant)
    t = now()
    job_id = "job-" + secrets.token_hex(8)
    return job_repo.create({
        "id": job_id, "tenant": tenant, "name": manifest.name, "idempotency_key": key, "task": manifest.task,
        "manifest": json.dumps(manifest.to_dict()), "bundle_ref": manifest.bundle, "bundle_digest": digest,
        "input_uri": input_uri, "output_uri": output_uri, "work_uri": join(output_uri, "_work", job_id) + "/",
        "priority": manifest.priority, "schedule": schedule, "created_at": t, "updated_at": t,
        "deadline_at": (t + manifest.deadline_seconds) if manifest.deadline_seconds else None,
        "retry_of": retry_of}, selection)


class IdempotencyConflict(LedgerError):
    """A manifest differs from the one first submitted under its idempotency key."""


def _diff(old: object, new: object, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for k in sorted(set(old) | set(new), key=str)
                for d in _diff(old.get(k), new.get(k), f"{path}.{k}" if path else str(k))]
    return [] if old == new else [path or "(manifest)"]


def check_same_manifest(job_id: str, key: str, manifest: JobManifest) -> None:
    """Reusing an idempotency key with a changed manifest is refused (as Stripe does)."""
    changed = _diff(job_repo.stored_manifest(job_id), json.loads(json.dumps(manifest.to_dict())))
    if changed:
        raise IdempotencyConflict(
            f"idempotency_key {key!r} was used by job {job_id} with a different manifest; these fields "
            f"differ: {', '.join(changed)}. Submit it under a new idempotency_key, or restore the fields")


def _check_output_free(output_uri: str, tenant: str) -> None:
    """Two jobs never share an output prefix: their parts would mix. (Another tenant's job is not
    named.)"""
    other = job_repo.active_output_user(output_uri)
    if other:
        which = f"active job {other[0]}" if other[1] == tenant else "another tenant's active job"
        raise ManifestError(f"output {output_uri} is in use by {which}; choose another "
                            "output.uri or cancel that job")
    if get_store(output_uri).exists(join(output_uri, "_SUCCESS")):
        raise ManifestError(f"output {output_uri} already holds a published job (_SUCCESS exists); "
                            "choose a new output.uri or delete the old output first")


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
