"""Create a job: the one function every path that makes a job goes through (bundle reference ->
digest, idempotency, the caller's grants, output ownership, limits)."""

from __future__ import annotations

import json
import secrets

from batchinf import scopes
from batchinf.bundles import get_info, resolve_ref
from batchinf.errors import LedgerError, ManifestError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger.events import now
from batchinf.limits import check_manifest
from batchinf.manifest import JobManifest
from batchinf.scopes import Caller
from batchinf.store import get_store, join


def submit(manifest: JobManifest, caller: Caller, *, schedule: str | None = None, retry_of: str | None = None,
           selection: list[tuple[str, int]] | None = None, hold: bool = False,
           process_started_at: float | None = None) -> tuple[str, bool]:
    """Create the job for `caller`, or return the caller's existing one for the same idempotency
    key (a different manifest under a used key is an IdempotencyConflict naming the fields that
    differ).

    Returns (job_id, created). The bundle reference is resolved to a digest here, once: moving an
    alias later never changes what this job runs. Storage is checked here (scopes.py): the input
    and output against the tenant's grants when the caller is confined (a tenant's request always
    is), and the output prefix against every other job's. `retry_of`/`selection`: see rerun.py.
    `hold`: a dry run's job (dryrun.py), held `planned` once its shards are cut.
    `process_started_at`: when the calling process started (`batchinf run`), so that the job's
    phases count its start-up (batchinf/phases.py)."""
    tenant = caller.tenant
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
    check_manifest(manifest, digest, tenant)       # every number the tenant set, against its limits
    engine = _engine(manifest, digest)
    device = _device(manifest, digest, engine)
    _check_max_length(manifest, digest)
    where = "input.uri" if manifest.input.uri else "input.manifest"
    plain = caller.operator
    given_input = scopes.canonical(manifest.input.uri or manifest.input.manifest or "", where, plain)
    given_output = scopes.as_prefix(scopes.canonical(manifest.output_uri, "output.uri", plain))
    confined = caller.confined
    if confined:        # checked by their real paths; a refusal names them as written (no symlink target shows)
        scopes.check(tenant, given_input, scopes.READ, "input")
        scopes.check(tenant, given_output, scopes.WRITE, "output")
    input_uri, output_uri = scopes.real(given_input), scopes.as_prefix(scopes.real(given_output))
    scopes.check_output(tenant, output_uri, input_uri)
    if get_store(output_uri).exists(join(output_uri, "_SUCCESS")):
        raise ManifestError(f"output {output_uri} already holds a published job (_SUCCESS exists); "
                            "choose a new output.uri or delete the old output first")
    t = now()
    job_id = "job-" + secrets.token_hex(8)
    return job_repo.create({
        "id": job_id, "tenant": tenant, "name": manifest.name, "idempotency_key": key, "task": manifest.task,
        "manifest": json.dumps(manifest.to_dict()), "bundle_ref": manifest.bundle, "bundle_digest": digest,
        "input_uri": input_uri, "output_uri": output_uri, "work_uri": join(output_uri, "_work", job_id) + "/",
        "priority": manifest.priority, "schedule": schedule, "created_at": t, "updated_at": t, "confined": confined,
        "deadline_at": (t + manifest.deadline_seconds) if manifest.deadline_seconds else None,
        "retry_of": retry_of, "hold": hold, "engine": engine, "device": device,
        "phases": json.dumps({"process_started_at": process_started_at}) if process_started_at else None}, selection)


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


def _engine(manifest: JobManifest, digest: str) -> str:
    """The engine the job runs on: the manifest's, else the bundle's declared one, else native."""
    from batchinf.engines import job_engine
    from batchinf.ledger.registry import meta

    return job_engine(manifest.engine, meta(digest), manifest.task, manifest.bundle,
                      getattr(manifest.options, "device", "auto"))


def _device(manifest: JobManifest, digest: str, engine: str) -> str:
    """The device the job's shards need: options.device unless auto, else the bundle's, else any."""
    from batchinf.engines import job_device
    from batchinf.ledger.registry import meta

    return job_device(getattr(manifest.options, "device", "auto"), meta(digest), engine, manifest.bundle)


def _check_max_length(manifest: JobManifest, digest: str) -> None:
    """options.max_length may not exceed the bundle's own limit (it used to be clamped silently)."""
    from batchinf.ledger.registry import meta

    wanted = getattr(manifest.options, "max_length", None)
    limit = meta(digest).get("max_length")
    if wanted is not None and limit is not None and wanted > limit:
        raise ManifestError(f"options.max_length {wanted} exceeds bundle {manifest.bundle}'s max length {limit}; "
                            f"set options.max_length to at most {limit}, or leave it out to use {limit}")
