"""Submit a job (bundle reference -> digest, idempotency) and pin its inputs."""

from __future__ import annotations

import json
import secrets

from batchinf.bundles import get_info, resolve_ref
from batchinf.errors import InputError, ManifestError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger.events import now
from batchinf.manifest import JobManifest
from batchinf.store import ObjectPin, get_store, join, normalize_uri


def submit(manifest: JobManifest, *, tenant: str = "default", schedule: str | None = None) -> tuple[str, bool]:
    """Create the job, or return the existing one for the same idempotency key.

    Returns (job_id, created). The bundle reference is resolved to a digest here, once: moving an
    alias later never changes what this job runs."""
    key = manifest.idempotency_key or manifest.content_key()
    existing = job_repo.find_by_key(tenant, key)
    if existing:
        return existing, False
    digest = resolve_ref(manifest.bundle)
    bundle_task = get_info(digest).task
    if bundle_task != manifest.task:
        raise ManifestError(f"bundle {manifest.bundle} is a {bundle_task} model and this job's task is "
                            f"{manifest.task}; choose a {manifest.task} bundle or set task: {bundle_task}")
    _check_max_length(manifest, digest)
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
        "deadline_at": (t + manifest.deadline_seconds) if manifest.deadline_seconds else None})


def _check_max_length(manifest: JobManifest, digest: str) -> None:
    """options.max_length may not exceed the bundle's own limit (it used to be clamped silently)."""
    from batchinf.ledger.registry import meta

    wanted = getattr(manifest.options, "max_length", None)
    limit = meta(digest).get("max_length")
    if wanted is not None and limit is not None and wanted > limit:
        raise ManifestError(f"options.max_length {wanted} exceeds bundle {manifest.bundle}'s max length {limit}; "
                            f"set options.max_length to at most {limit}, or leave it out to use {limit}")


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
    """A JSONL list of objects or an S3 Inventory manifest.json (formats/inventory.py); the listed
    objects are HEADed in parallel, in the manifest's order."""
    from concurrent.futures import ThreadPoolExecutor

    from batchinf.formats.inventory import entries

    listed = entries(uri, get_store(uri).get_bytes(uri), lambda u: get_store(u).get_bytes(u))
    if not listed:
        raise InputError(f"input manifest {uri} lists no objects")
    with ThreadPoolExecutor(max_workers=min(16, len(listed))) as pool:
        return list(pool.map(lambda e: get_store(e[0]).head(e[0], version_id=e[1]), listed))
