"""Verify and publish: check coverage and digests, promote the winning attempts' files, then
write `_MANIFEST.json` and, last, `_SUCCESS`. Nothing else writes those two files.

Coverage: every pinned input record, identified by (source object, ordinal), appears exactly
once across result and error parts, and no record id succeeds twice.
"""

from __future__ import annotations

import json
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
from batchinf import failpoints
from batchinf.errors import BatchinfError, StoreError, TransientError, VerificationError
from batchinf.digests import sha256_file
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import lineage, registry
from batchinf.ledger import shards as shard_repo
from batchinf.ledger.events import now
from batchinf.ledger.models import Job, Shard
from batchinf.ledger.states import SHARD_DONE, JobStatus, ShardStatus
from batchinf.openai.output import RenderContext, fingerprint, render_not_run, render_part, render_to_path
from batchinf.parts import digest_of_uri, read_table
from batchinf.store import get_store, join, normalize_uri
from batchinf.store.base import transient_os_error
from batchinf.tasks import get_task
from batchinf.version import __version__

MANIFEST = "_MANIFEST.json"
SUCCESS = "_SUCCESS"
PARTIAL = "_PARTIAL.json"


@contextmanager
def _readable(what: str) -> Iterator[None]:
    """What cannot be read fails verification (missing, truncated, edited), unless storage failed:
    a fault that may pass (TransientError, an OSError such as EIO) is raised as TransientError for
    the lifecycle to retry, and a store refusing the request (StoreError) as itself."""
    try:
        yield
    except (TransientError, StoreError):
        raise
    except OSError as exc:
        if transient_os_error(exc):
            raise TransientError(f"{what} cannot be read now: {exc}") from exc
        raise VerificationError(f"{what} cannot be read: {exc}") from exc
    except (BatchinfError, pa.ArrowException, ValueError) as exc:   # missing, truncated, not JSON
        raise VerificationError(f"{what} cannot be read: {exc}") from exc


def _digest(uri: str) -> tuple[str, int]:
    with _readable(f"part {uri}"):
        return digest_of_uri(uri)


def check_coverage(inputs: list[dict[str, Any]], parts: Iterable[tuple[str, str]]) -> None:
    """inputs: [{uri, records}], with `ordinals` listing the only records a retry job covers;
    parts: (uri, kind) Parquet files with source/ordinal/record_id. Raises VerificationError
    naming the first record missing, seen twice, or not selected."""
    seen = {i["uri"]: np.zeros(int(i["records"]), dtype=np.int8) for i in inputs}
    wanted = {i["uri"]: np.ones(int(i["records"]), dtype=bool) for i in inputs}
    for i in inputs:
        if i.get("ordinals") is not None:
            wanted[i["uri"]][:] = False
            wanted[i["uri"]][np.asarray(i["ordinals"], dtype=np.int64)] = True
    ids: set[str] = set()
    for uri, kind in parts:
        with _readable(f"part {uri}"):
            t = read_table(uri, columns=["record_id", "source", "ordinal"])
        sources = t.column("source").to_pylist()
        ordinals = t.column("ordinal").to_numpy()
        for src in set(sources):
            if src not in seen:
                raise VerificationError(f"{uri} holds records of {src}, which is not a pinned input")
        for src, o in zip(sources, ordinals):
            arr = seen[src]
            if o < 0 or o >= arr.size:
                raise VerificationError(f"{uri}: record {o} of {src} is beyond its {arr.size} records")
            arr[o] += 1
        if kind == "results":
            for rid in t.column("record_id").to_pylist():
                if rid in ids:
                    raise VerificationError(f"record id {rid!r} has two results (second in {uri})")
                ids.add(rid)
    for src, arr in seen.items():
        missing, dup = np.flatnonzero((arr == 0) & wanted[src]), np.flatnonzero(arr > 1)
        extra = np.flatnonzero((arr > 0) & ~wanted[src])
        if extra.size:
            raise VerificationError(f"record {extra[0]} of {src} is not one this retry job selected")
        if dup.size:
            raise VerificationError(f"record {dup[0]} of {src} appears {arr[dup[0]]} times")
        if missing.size:
            raise VerificationError(f"record {missing[0]} of {src} is missing ({missing.size} missing)")


def _committed_parts(rows: list[Shard]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The committed shards' files, checked against the digests and row counts in the ledger,
    with the keys they get under the output prefix."""
    parts, sources = [], []
    numbers = {"results": 0, "errors": 0}
    for r in rows:   # committed shards, and quarantined ones holding a poison error row
        if r.status not in SHARD_DONE:
            continue
        for kind, src, sha, count in (("results", r.output_uri, r.output_sha256, r.output_rows),
                                      ("errors", r.errors_uri, r.errors_sha256, r.error_rows)):
            if not count:
                continue
            key = ("" if kind == "results" else "errors/") + f"part-{numbers[kind]:05d}.parquet"
            numbers[kind] += 1
            got_sha, got_rows = _digest(src)
            if (got_sha, got_rows) != (sha, count):
                raise VerificationError(f"{src} (shard {r.id}) has sha256 {got_sha[:12]}… and {got_rows} "
                                        f"rows; the ledger committed {sha[:12]}… and {count}")
            sources.append((src, kind))
            parts.append({"key": key, "kind": kind, "sha256": sha, "rows": count, "shard": r.id})
    return parts, sources


def _promote(out: str, parts: list[dict[str, Any]], sources: list[tuple[str, str]]) -> None:
    store = get_store(out)
    for part, (src, _) in zip(parts, sources):
        store.copy(src, join(out, part["key"]))


def _render_openai(out: str, parts: list[dict[str, Any]], ctx: RenderContext) -> list[dict[str, Any]]:
    """OpenAI batch output lines: one JSONL file per promoted Parquet part, in the parts' order;
    each lists its source part under "from"."""
    rendered = []
    for n, p in enumerate(q for q in parts if q["kind"] in ("results", "errors")):
        key = f"openai/part-{n:05d}.jsonl"
        sha, lines = render_part(join(out, p["key"]), p["kind"], ctx, join(out, key))
        rendered.append({"key": key, "kind": "openai", "sha256": sha, "rows": lines, "from": p["key"]})
    return rendered


def _summary(job: Job, out: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The task's own counts for `_MANIFEST.json` (generate: finish reasons; classify: labels;
    score: a score histogram), from the promoted result parts."""
    task = get_task(job.task)
    if not task.summary_columns:
        return {}
    return task.summarize(read_table(join(out, p["key"]), columns=list(task.summary_columns))
                          for p in parts if p["kind"] == "results")


def _openai_context(job: Job) -> RenderContext | None:
    if job.manifest.input.format != "openai-batch":
        return None
    return RenderContext(job_id=job.id, created=int(job.created_at), model=job.bundle_ref, task=job.task,
                         system_fingerprint=fingerprint(job.bundle_digest))


def _implementation(digest: str) -> dict[str, str]:
    """What computed the job's results: batchinf's native runtime, or (a bundle imported through the
    transformers fallback) transformers at the version its fixtures were computed and checked with."""
    meta = registry.meta(digest)
    return meta.get("implementation") or {"name": "batchinf", "version": __version__}


def _precision(job: Job) -> str:
    """The numeric precision that computed the results: int8 for an int8 bundle (CPU only); else
    float32 on CPU, the bundle's dtype on CUDA."""
    meta = registry.meta(job.bundle_digest)
    dtype, device = str(meta.get("dtype", "float32")), getattr(job.manifest.options, "device", "auto")
    if meta.get("precision") == "int8" or dtype == "float32" or device == "cpu":
        return str(meta.get("precision", "float32"))
    return dtype if device == "cuda" else f"{dtype} on CUDA, float32 on CPU"


def _not_done(rows: list[Shard]) -> list[Shard]:
    """Shards whose records have no committed row: neither done nor split into children."""
    parents = {r.parent_id for r in rows if r.parent_id}
    return [r for r in rows if r.id not in parents
            and (r.status not in SHARD_DONE or (r.status == ShardStatus.QUARANTINED and not r.errors_uri))]


def _render_not_run(job: Job, rows: list[Shard], code: str, ctx: RenderContext) -> list[dict[str, Any]]:
    """`batch_cancelled` / `batch_expired` lines for every request that never ran, one file per
    not-done shard, so each custom_id appears exactly once across the openai/ files."""
    rendered = []
    for n, r in enumerate(_not_done(rows)):
        key = f"openai/not-run-{n:05d}.jsonl"
        sha, lines = render_not_run(r.input_uri, code, ctx, join(job.output_uri, key))
        rendered.append({"key": key, "kind": "openai", "sha256": sha, "rows": lines, "from": r.id, "error": code})
    return rendered


def _inputs(job: Job) -> list[dict[str, Any]]:
    chosen = lineage.selection(job.id) if job.retry_of else None
    return [{**o.pin.to_dict(), "records": o.records,
             **({"ordinals": sorted(chosen.get(o.pin.uri, ()))} if chosen is not None else {})}
            for o in job_repo.inputs(job.id)]


def _lineage(job: Job) -> dict[str, Any]:
    """retry_of: the job this one retries (the original's manifest lists its `retries`)."""
    if not job.retry_of:
        return {}
    return {"retry_of": {"job_id": job.retry_of, "output_uri": job_repo.get(job.retry_of).output_uri}}


def publish_partial(job: Job) -> dict[str, Any]:
    """cancelling -> cancelled (or expired, past its deadline): promote what was committed and
    describe in `_PARTIAL.json` which shards and records are done and which are not.
    `_MANIFEST.json` and `_SUCCESS` are never written for such a job."""
    rows = shard_repo.of_job(job.id)
    parts, sources = _committed_parts(rows)
    _promote(job.output_uri, parts, sources)
    ctx = _openai_context(job)
    expired = job.deadline_at is not None and job.deadline_at <= now()
    if ctx is not None:     # the done records' OpenAI lines, and an error line for each one not run
        parts += _render_openai(job.output_uri, parts, ctx)
        parts += _render_not_run(job, rows, "batch_expired" if expired else "batch_cancelled", ctx)
    done = [r for r in rows if r.status == ShardStatus.COMMITTED]
    partial = {
        "job_id": job.id, "status": (JobStatus.EXPIRED if expired else JobStatus.CANCELLED).value, "reason": job.error,
        "bundle_digest": job.bundle_digest, "precision": _precision(job), "output_uri": job.output_uri,
        "inputs": _inputs(job),
        "parts": parts,
        "counts": {"records_total": job.records_total,
                   "records_done": sum(r.num_records for r in done),
                   "records_succeeded": sum(r.output_rows or 0 for r in done),
                   "records_failed": sum(r.error_rows or 0 for r in done),
                   "records_not_done": sum(r.num_records for r in rows if r.status != ShardStatus.COMMITTED)},
        # records of a done shard are exactly the rows of its parts; a not-done shard's records
        # are listed (source, ordinal, record_id) in its staged file until the work prefix is removed
        "shards_done": [{"shard": r.id, "records": r.num_records} for r in done],
        "shards_not_done": [{"shard": r.id, "status": r.status, "records": r.num_records,
                             "staged_records": r.input_uri} for r in rows if r.status != ShardStatus.COMMITTED],
        "created_at": datetime.now(timezone.utc).isoformat(),
        **_lineage(job),
    }
    if ctx is not None:
        partial["openai"] = ctx.to_dict()
    get_store(job.output_uri).put_bytes(join(job.output_uri, PARTIAL), json.dumps(partial, indent=1).encode())
    job_repo.move(job.id, JobStatus.EXPIRED if expired else JobStatus.CANCELLED, detail={"parts": len(parts)},
                  finished_at=now())
    return partial


def publish(job: Job) -> dict[str, Any]:
    """verifying -> succeeded. Safe to re-run after a crash at any point: promotion copies are
    idempotent and `_SUCCESS` is written only after `_MANIFEST.json`."""
    t0 = time.perf_counter()
    job_id = job.id
    if job.status != JobStatus.VERIFYING:
        raise VerificationError(f"job {job_id} is {job.status}, not verifying")
    rows = shard_repo.of_job(job_id)
    not_done = [r.id for r in rows if r.status not in SHARD_DONE]
    if not_done:
        raise VerificationError(f"job {job_id}: shard {not_done[0]} is not committed")
    inputs = _inputs(job)
    out = job.output_uri
    store = get_store(out)
    parts, sources = _committed_parts(rows)
    check_coverage(inputs, sources)
    _promote(out, parts, sources)
    ctx = _openai_context(job)
    if ctx is not None:
        parts += _render_openai(out, parts, ctx)
    plan = job.plan
    sums = {k: sum(getattr(r, k) or 0 for r in rows)
            for k in ("tokens_input", "tokens_output", "tokens_real", "tokens_padded",
                      "output_rows", "error_rows", "execute_seconds")}
    manifest = {
        "job_id": job.id, "name": job.name, "task": job.task, "bundle": job.bundle_ref,
        "bundle_digest": job.bundle_digest, "implementation": _implementation(job.bundle_digest),
        "precision": _precision(job),
        "input_uri": job.input_uri, "output_uri": out, "inputs": inputs, "parts": parts,
        "counts": {"records_total": job.records_total, "records_succeeded": sums["output_rows"],
                   "records_failed": sums["error_rows"], "records_truncated": plan.get("truncated", 0)},
        "tokens": {"input": sums["tokens_input"], "output": sums["tokens_output"],
                   "real": sums["tokens_real"], "padded": sums["tokens_padded"]},
        "shards": {"total": len(rows), "bucket_bounds": plan.get("bucket_bounds", [])},
        "timings": {"plan": job.plan_seconds, "execute": sums["execute_seconds"],
                    "execute_wall": (now() - job.started_at - (job.plan_seconds or 0))
                    if job.started_at else None,
                    "verify": time.perf_counter() - t0},
        "created_at": datetime.now(timezone.utc).isoformat(),
        **_lineage(job),
    }
    summary = _summary(job, out, parts)
    manifest["counts"].update(summary)
    if ctx is not None:
        manifest["openai"] = ctx.to_dict()
    if manifest["counts"]["records_succeeded"] + manifest["counts"]["records_failed"] != job.records_total:
        raise VerificationError(f"job {job_id}: {manifest['counts']} do not add up")
    failpoints.hit("verify.before_publish")
    store.put_bytes(join(out, MANIFEST), json.dumps(manifest, indent=1).encode())
    store.put_bytes(join(out, SUCCESS), b"")
    job_repo.move(job_id, JobStatus.SUCCEEDED, detail={"parts": len(parts)}, finished_at=now(),
                  verify_seconds=manifest["timings"]["verify"], summary=json.dumps(summary) if summary else None)
    store.delete_prefix(job.work_uri)
    if not store.list(join(out, "_work/")):
        store.delete_prefix(join(out, "_work/"))
    return manifest


def verify_output(output_uri: str) -> dict[str, Any]:
    """Re-check a published output from its `_MANIFEST.json` alone: part digests and row counts,
    coverage of every pinned input record, counts that add up."""
    store = get_store(output_uri)
    with _readable(join(output_uri, MANIFEST)):
        manifest = json.loads(store.get_bytes(join(output_uri, MANIFEST)))
    if not store.exists(join(output_uri, SUCCESS)):
        raise VerificationError(f"{join(output_uri, SUCCESS)} is missing")
    _no_unlisted_parts(output_uri, manifest)
    parquet = [p for p in manifest["parts"] if p["kind"] != "openai"]
    for p in parquet:
        sha, rows = _digest(join(output_uri, p["key"]))
        if (sha, rows) != (p["sha256"], p["rows"]):
            raise VerificationError(f"{p['key']}: sha256 {sha[:12]}… / {rows} rows, manifest says "
                                    f"{p['sha256'][:12]}… / {p['rows']}")
    check_coverage(manifest["inputs"], [(join(output_uri, p["key"]), p["kind"]) for p in parquet])
    c = manifest["counts"]
    if c["records_succeeded"] + c["records_failed"] != c["records_total"]:
        raise VerificationError(f"counts do not add up: {c}")
    if "openai" in manifest:
        _verify_openai(output_uri, manifest)
    return {"ok": True, "output_uri": output_uri, "parts": len(manifest["parts"]), "counts": c}


def _no_unlisted_parts(output_uri: str, manifest: dict[str, Any]) -> None:
    """Nothing beside the listed parts looks like a part: a `part-*` file, or a file under
    `errors/` or `openai/`, that the manifest does not list was not published by this job."""
    listed = {p["key"] for p in manifest["parts"]}
    base = normalize_uri(output_uri).rstrip("/") + "/"
    for pin in get_store(base).list(base):
        key = pin.uri[len(base):] if pin.uri.startswith(base) else pin.uri
        if key.startswith("_work/") or key in listed:
            continue
        if key.split("/")[-1].startswith("part-") or key.startswith(("errors/", "openai/")):
            raise VerificationError(f"{join(output_uri, key)} is not listed in {MANIFEST}: it was not published by "
                                    f"job {manifest.get('job_id')}; remove it, or re-run the job to a new output")


def _verify_openai(output_uri: str, manifest: dict[str, Any]) -> None:
    """The openai/ files are exactly what the Parquet parts render to (so they hold one line per
    input record, like the parts), and their digests match the manifest."""
    ctx = RenderContext(**manifest["openai"])
    rendered = [p for p in manifest["parts"] if p["kind"] == "openai"]
    parquet = {p["key"]: p for p in manifest["parts"] if p["kind"] != "openai"}
    if sorted(p["from"] for p in rendered) != sorted(parquet):
        raise VerificationError("openai/ files do not correspond one to one to the Parquet parts")
    if sum(p["rows"] for p in rendered) != manifest["counts"]["records_total"]:
        raise VerificationError(f"openai/ files hold {sum(p['rows'] for p in rendered)} lines for "
                                f"{manifest['counts']['records_total']} records")
    store = get_store(output_uri)
    with tempfile.TemporaryDirectory() as tmp:
        for p in rendered:
            uri = join(output_uri, p["key"])
            local = f"{tmp}/{p['key'].replace('/', '_')}"
            with _readable(uri):
                store.download_file(uri, local)
            if sha256_file(local) != p["sha256"]:
                raise VerificationError(f"{p['key']}: sha256 differs from the manifest's")
            want, _ = render_to_path(join(output_uri, p["from"]), parquet[p["from"]]["kind"], ctx,
                                     local + ".want")
            if want != p["sha256"]:
                raise VerificationError(f"{p['key']} is not what {p['from']} renders to")
