"""Verify and publish: check coverage and digests, promote the winning attempts' files, then
write `_MANIFEST.json` and, last, `_SUCCESS`. Nothing else writes those two files.

Coverage: every pinned input record, identified by (source object, ordinal), appears exactly
once across result and error parts, and no record id succeeds twice.
Records staged in pieces are read with the parts and published as parts of their own (assembly.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchinf import failpoints, phases
from batchinf.errors import BatchinfError, StoreError, TransientError, VerificationError
from batchinf.digests import sha256_file
from batchinf.ledger import attempts as attempt_repo
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import registry, retry_records
from batchinf.ledger import shards as shard_repo
from batchinf.ledger.events import now
from batchinf.ledger.models import Job, Shard
from batchinf.ledger.states import SHARD_DONE, JobStatus, ShardStatus
from batchinf.openai.output import RenderContext, fingerprint, render_not_run, render_to_path
from batchinf.assembly import Pieces, assembled_parts
from batchinf.parts import local_copy, staged_file
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


COVERAGE_COLUMNS = ["record_id", "source", "ordinal"]


class Coverage:
    """Every pinned input record, by (source, ordinal), exactly once across the parts `add`ed; no
    record id succeeds twice. inputs: [{uri, records}], with `ordinals` listing the only records
    a retry job covers. Raises VerificationError naming the first record missing, seen twice, or
    not selected."""

    def __init__(self, inputs: list[dict[str, Any]]) -> None:
        self.seen = {i["uri"]: np.zeros(int(i["records"]), dtype=np.int8) for i in inputs}
        self.wanted = {i["uri"]: np.ones(int(i["records"]), dtype=bool) for i in inputs}
        for i in inputs:
            if i.get("ordinals") is not None:
                self.wanted[i["uri"]][:] = False
                self.wanted[i["uri"]][np.asarray(i["ordinals"], dtype=np.int64)] = True
        self.ids: set[str] = set()

    def add(self, uri: str, kind: str, t: pa.Table) -> None:
        """One part's records (its COVERAGE_COLUMNS)."""
        sources = t.column("source").to_pylist()
        ordinals = t.column("ordinal").to_numpy()
        for src in set(sources):
            if src not in self.seen:
                raise VerificationError(f"{uri} holds records of {src}, which is not a pinned input")
        for src, o in zip(sources, ordinals):
            arr = self.seen[src]
            if o < 0 or o >= arr.size:
                raise VerificationError(f"{uri}: record {o} of {src} is beyond its {arr.size} records")
            arr[o] += 1
        if kind == "results":
            for rid in t.column("record_id").to_pylist():
                if rid in self.ids:
                    raise VerificationError(f"record id {rid!r} has two results (second in {uri})")
                self.ids.add(rid)

    def check(self) -> None:
        """After the last part."""
        for src, arr in self.seen.items():
            wanted = self.wanted[src]
            missing, dup = np.flatnonzero((arr == 0) & wanted), np.flatnonzero(arr > 1)
            extra = np.flatnonzero((arr > 0) & ~wanted)
            if extra.size:
                raise VerificationError(f"record {extra[0]} of {src} is not one this retry job selected")
            if dup.size:
                raise VerificationError(f"record {dup[0]} of {src} appears {arr[dup[0]]} times")
            if missing.size:
                raise VerificationError(f"record {missing[0]} of {src} is missing ({missing.size} missing)")


@dataclass
class PartCopy:
    """One part as read: its local copy (removed after use), its digest and rows, and the columns asked for."""
    path: str
    sha256: str
    rows: int
    table: pa.Table | None


@contextmanager
def read_part(uri: str, columns: list[str] | None = None) -> Iterator[PartCopy]:
    """The one read of a part: downloaded once (a local part is opened in place), hashed, its row
    count and `columns` read from that copy. What cannot be read fails verification (`_readable`)."""
    with ExitStack() as stack:
        with _readable(f"part {uri}"):
            path = stack.enter_context(local_copy(uri))
            pf = pq.ParquetFile(path)
            table = pf.read(columns=columns) if columns else None
            part = PartCopy(path, sha256_file(path), pf.metadata.num_rows, table)
        yield part


def _committed_parts(rows: list[Shard]) -> tuple[list[dict[str, Any]], list[str]]:
    """The committed shards' files as the ledger has them (digest, rows), with the keys they get
    under the output prefix."""
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
            sources.append(src)
            parts.append({"key": key, "kind": kind, "sha256": sha, "rows": count, "shard": r.id})
    return parts, sources


@dataclass
class Published:
    """What the output documents need from the parts, read once each."""
    parts: list[dict[str, Any]]          # the promoted parts, then their OpenAI renderings
    summary: dict[str, Any]              # the task's counts (`Task.summarize`) when asked for; `pieces`: assembly.py
    files: list[dict[str, Any]] = field(default_factory=list)   # the task's other files (`Task.output_files`)
    errors: list[dict[str, Any]] = field(default_factory=list)  # assembled error rows, for the ledger's record errors

    @property
    def assembled(self) -> tuple[int, int]:
        """(succeeded, failed): the records assembled from pieces, which no shard's rows count."""
        c = self.summary.get("pieces") or {}
        return int(c.get("succeeded", 0)), int(c.get("failed", 0))


def _promote_parts(job: Job, rows: list[Shard], coverage: Coverage | None, summarize: bool,
                   ctx: RenderContext | None) -> Published:
    """Read each committed part once: check its digest and rows against the ledger, and (`coverage`)
    its records; take the task's summary columns (`summarize`, or a task that stages files) and
    render its OpenAI lines (`ctx`) from that copy; check each file the part's rows name against the
    copy its attempt staged (`StagedFiles`). Only once all passed is anything written under the
    output prefix: each part and staged file copied there (server-side on S3), then the renderings
    uploaded."""
    out = job.output_uri
    parts, sources = _committed_parts(rows)
    task = get_task(job.task)
    wanted = list(task.summary_columns) if summarize or task.stages_files else []
    tables: list[pa.Table] = []
    staged = StagedFiles(out)
    rendered: list[tuple[dict[str, Any], str]] = []
    pieces = Pieces(task, read_part) if task.piece_schema is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        for n, (p, src) in enumerate(zip(parts, sources)):
            covered = coverage is not None or (pieces is not None and p["kind"] == "errors")
            columns = (COVERAGE_COLUMNS if covered else []) + (wanted if p["kind"] == "results" else [])
            with read_part(src, columns or None) as got:
                if (got.sha256, got.rows) != (p["sha256"], p["rows"]):
                    raise VerificationError(f"{src} (shard {p['shard']}) has sha256 {got.sha256[:12]}… and {got.rows} "
                                            f"rows; the ledger committed {p['sha256'][:12]}… and {p['rows']}")
                if coverage is not None:
                    coverage.add(src, p["kind"], got.table)
                if pieces is not None:
                    pieces.add_part(p["kind"], src, p["shard"], got)
                if wanted and p["kind"] == "results":
                    tables.append(got.table.select(wanted))
                    if task.stages_files:
                        staged.add(src, p["shard"], task.output_files(tables[-1:]))
                if p["kind"] == "results" and task.renders(job.manifest.options):
                    rendered += _task_files(task, job, got.path, p["key"], tmp, n)
                if ctx is not None:
                    local = os.path.join(tmp, f"openai-{n:05d}.jsonl")
                    sha, lines = render_to_path(got.path, p["kind"], ctx, local, staged.read)
                    rendered.append(({"key": f"openai/part-{n:05d}.jsonl", "kind": "openai", "sha256": sha,
                                      "rows": lines, "from": p["key"]}, local))
        assembled, counts, errors = [], {}, []
        if pieces is not None:
            pieces.add_empty_parts(rows)
            got_pieces, counts = pieces.assemble(complete=coverage is not None)
            if got_pieces is not None:
                assembled = assembled_parts(got_pieces, parts, pieces.shards, tmp)
                errors = pieces.ledger_rows(got_pieces.errors)
            for n, (p, local, table) in enumerate(assembled, len(parts)):
                if coverage is not None:
                    coverage.add(local, p["kind"], table.select(COVERAGE_COLUMNS))
                if p["kind"] == "results":
                    if wanted:
                        tables.append(table.select(wanted))
                    if task.renders(job.manifest.options):     # subtitles from the stitched rows
                        rendered += _task_files(task, job, local, p["key"], tmp, n)
        if coverage is not None:
            coverage.check()
        staged.check()
        store = get_store(out)
        for p, src in zip(parts, sources):
            store.copy(src, join(out, p["key"]))
        for p, local, _ in assembled:
            store.put_file(join(out, p["key"]), local)
        staged.promote()
        for r, local in rendered:
            store.put_file(join(out, r["key"]), local)
    summary = task.summarize(tables) if summarize else {}
    if counts:
        summary["pieces"] = counts
    return Published(parts + [p for p, _, _ in assembled] + [r for r, _ in rendered], summary,
                     task.output_files(tables) if wanted else [], errors)


FILE_THREADS = 8    # staged files checked, then copied, this many at a time


class StagedFiles:
    """The files (generate_image's images) that the committed attempts staged beside their parts
    (`parts.staged_file`), each for a key under the output prefix, with the sha256 its part's row
    gives: checked (`check`), then copied to their keys (`promote`); what a losing or failed
    attempt staged is never read."""

    def __init__(self, output_uri: str) -> None:
        self.out = output_uri
        self.files: list[tuple[str, dict[str, Any], str]] = []      # (staged URI, entry, shard)
        self.by_uri: dict[str, str] = {}                             # final URI -> staged URI

    def add(self, part_uri: str, shard: str, entries: list[dict[str, Any]]) -> None:
        """The files a committed part's rows name (`Task.output_files` entries: key, sha256, record_id)."""
        for f in entries:
            src = staged_file(part_uri, f["key"])
            self.files.append((src, f, shard))
            self.by_uri[join(self.out, f["key"])] = src

    def read(self, uri: str) -> bytes:
        """The bytes a row's file URI (under the output) will have: its staged copy's."""
        src = self.by_uri.get(uri)
        if src is None:
            raise VerificationError(f"{uri} is named by a result row but no committed attempt staged it")
        with _readable(src):
            return get_store(src).get_bytes(src)

    def _check_one(self, item: tuple[str, dict[str, Any], str]) -> None:
        src, f, shard = item
        with _readable(f"{src} ({f['kind']} of record {f.get('record_id')!r}, shard {shard})"):
            got = hashlib.sha256(get_store(src).get_bytes(src)).hexdigest()
        if got != f["sha256"]:
            raise VerificationError(f"{src} ({f['kind']} of record {f.get('record_id')!r}, shard {shard}) has sha256 "
                                    f"{got[:12]}…; its result row says {f['sha256'][:12]}…: the staged file changed "
                                    "after its attempt committed; run the job again to a new output")

    def check(self) -> None:
        self._each(self._check_one)

    def promote(self) -> None:
        """Copy each staged file to its key (idempotent: publishing again copies the same bytes)."""
        self._each(lambda item: get_store(self.out).copy(item[0], join(self.out, item[1]["key"])))

    def _each(self, fn: Any) -> None:
        if not self.files:
            return
        with ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="files") as pool:
            for _ in pool.map(fn, self.files):
                pass


def _task_files(task: Any, job: Job, part_path: str, part_key: str, tmp: str,
                n: int) -> list[tuple[dict[str, Any], str]]:
    """The extra files (subtitles) the task renders from one result part, written to `tmp`."""
    out = []
    for k, (kind, key, data) in enumerate(task.render(pq.read_table(part_path), job.manifest.options)):
        local = os.path.join(tmp, f"task-{n:05d}-{k:06d}")
        with open(local, "wb") as fh:
            fh.write(data)
        out.append(({"key": key, "kind": kind, "sha256": hashlib.sha256(data).hexdigest(), "rows": 1,
                     "from": part_key}, local))
    return out


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
    if meta.get("backend"):         # a bundle run through another library (CTranslate2) states its own
        return str(meta["precision"])
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
    chosen = retry_records.selection(job.id) if job.retry_of else None
    return [{**o.pin.to_dict(), "records": o.records,
             **({"ordinals": sorted(chosen.get(o.pin.uri, ()))} if chosen is not None else {})}
            for o in job_repo.inputs(job.id)]


def _lineage(job: Job) -> dict[str, Any]:
    """retry_of: the job this one retries (the original's manifest lists its `retries`)."""
    if not job.retry_of:
        return {}
    return {"retry_of": {"job_id": job.retry_of, "output_uri": job_repo.get(job.retry_of).output_uri}}


def job_phases(job: Job) -> dict[str, Any]:
    """Where the job's wall time went, up to now (batchinf/phases.py): written in its output
    document and kept in the ledger as it ends, so that its status shows the same numbers."""
    return phases.compute(job.phases, job.created_at, now=now(), attempts=attempt_repo.spans(job.id))


def publish_partial(job: Job) -> dict[str, Any]:
    """cancelling -> cancelled (or expired, past its deadline): promote what was committed and
    describe in `_PARTIAL.json` which shards and records are done and which are not.
    `_MANIFEST.json` and `_SUCCESS` are never written for such a job."""
    rows = shard_repo.of_job(job.id)
    ctx = _openai_context(job)
    published = _promote_parts(job, rows, None, False, ctx)
    parts = published.parts
    expired = job.deadline_at is not None and job.deadline_at <= now()
    if ctx is not None:     # and an OpenAI error line for each request not run
        parts += _render_not_run(job, rows, "batch_expired" if expired else "batch_cancelled", ctx)
    done = [r for r in rows if r.status == ShardStatus.COMMITTED]
    counts = {"records_total": job.records_total,
              "records_done": sum(r.num_records for r in done),
              "records_succeeded": sum(r.output_rows or 0 for r in done),
              "records_failed": sum(r.error_rows or 0 for r in done),
              "records_not_done": sum(r.num_records for r in rows if r.status != ShardStatus.COMMITTED)}
    if job.plan.get("pieces"):      # a shard's records are rows; a record staged in pieces is published whole
        ok, failed = published.assembled
        counts["records_succeeded"] += ok
        counts["records_failed"] += failed
        counts["records_done"] = counts["records_succeeded"] + counts["records_failed"]
        counts["records_not_done"] = (job.records_total or 0) - counts["records_done"]
    partial = {
        "job_id": job.id, "status": (JobStatus.EXPIRED if expired else JobStatus.CANCELLED).value, "reason": job.error,
        "bundle_digest": job.bundle_digest, "precision": _precision(job), "output_uri": job.output_uri,
        "inputs": _inputs(job),
        "parts": parts,
        "counts": counts,
        # records of a done shard are exactly the rows of its parts (and, staged in pieces, of the
        # assembled parts); a not-done shard's records are listed (source, ordinal, record_id) in
        # its staged file until the work prefix is removed
        "shards_done": [{"shard": r.id, "records": r.num_records} for r in done],
        "shards_not_done": [{"shard": r.id, "status": r.status, "records": r.num_records,
                             "staged_records": r.input_uri} for r in rows if r.status != ShardStatus.COMMITTED],
        "phases": job_phases(job),
        "created_at": datetime.now(timezone.utc).isoformat(),
        **_lineage(job),
    }
    if published.files:     # the done shards' images, copied under the output like their parts
        partial["files"] = published.files
    if ctx is not None:
        partial["openai"] = ctx.to_dict()
    get_store(job.output_uri).put_bytes(join(job.output_uri, PARTIAL), json.dumps(partial, indent=1).encode())
    job_repo.move(job.id, JobStatus.EXPIRED if expired else JobStatus.CANCELLED, detail={"parts": len(parts)},
                  finished_at=now(), errors=published.errors, phases={"final": partial["phases"]},
                  **({"summary": json.dumps(published.summary)} if published.summary else {}))
    return partial


def _output_manifest(job: Job, rows: list[Shard], inputs: list[dict[str, Any]], published: Published,
              ctx: RenderContext | None, verify_seconds: float) -> dict[str, Any]:
    """`_MANIFEST.json`: the one place it is built."""
    plan = job.plan
    sums = {k: sum(getattr(r, k) or 0 for r in rows)
            for k in ("tokens_input", "tokens_output", "tokens_real", "tokens_padded",
                      "output_rows", "error_rows", "execute_seconds")}
    output_manifest = {
        "job_id": job.id, "name": job.name, "task": job.task, "bundle": job.bundle_ref,
        "bundle_digest": job.bundle_digest, "implementation": _implementation(job.bundle_digest),
        "precision": _precision(job),
        "input_uri": job.input_uri, "output_uri": job.output_uri, "inputs": inputs, "parts": published.parts,
        "counts": {"records_total": job.records_total, "records_succeeded": sums["output_rows"] + published.assembled[0],
                   "records_failed": sums["error_rows"] + published.assembled[1],
                   "records_truncated": plan.get("truncated", 0), **published.summary},
        "tokens": {"input": sums["tokens_input"], "output": sums["tokens_output"],
                   "real": sums["tokens_real"], "padded": sums["tokens_padded"]},
        "shards": {"total": len(rows), "bucket_bounds": plan.get("bucket_bounds", [])},
        "timings": {"plan": job.plan_seconds, "execute": sums["execute_seconds"],
                    "execute_wall": (now() - job.started_at - (job.plan_seconds or 0))
                    if job.started_at else None,
                    "verify": verify_seconds},
        "phases": job_phases(job),
        "created_at": datetime.now(timezone.utc).isoformat(),
        **_lineage(job),
    }
    if published.files:
        output_manifest["files"] = published.files
    if ctx is not None:
        output_manifest["openai"] = ctx.to_dict()
    return output_manifest


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
    ctx = _openai_context(job)
    published = _promote_parts(job, rows, Coverage(inputs), True, ctx)
    output_manifest = _output_manifest(job, rows, inputs, published, ctx, time.perf_counter() - t0)
    counts = output_manifest["counts"]
    if counts["records_succeeded"] + counts["records_failed"] != job.records_total:
        raise VerificationError(f"job {job_id}: {counts} do not add up")
    failpoints.hit("verify.before_publish")
    store.put_bytes(join(out, MANIFEST), json.dumps(output_manifest, indent=1).encode())
    store.put_bytes(join(out, SUCCESS), b"")
    job_repo.move(job_id, JobStatus.SUCCEEDED, detail={"parts": len(output_manifest["parts"])}, finished_at=now(),
                  errors=published.errors,
                  verify_seconds=output_manifest["timings"]["verify"], phases={"final": output_manifest["phases"]},
                  summary=json.dumps(published.summary) if published.summary else None)
    store.delete_prefix(job.work_uri)
    if not store.list(join(out, "_work/")):
        store.delete_prefix(join(out, "_work/"))
    return output_manifest


PARQUET_KINDS = ("results", "errors")     # the other kinds are files rendered from them (openai/, srt/, vtt/)


def verify_output(output_uri: str) -> dict[str, Any]:
    """Re-check a published output from its `_MANIFEST.json` alone: part digests and row counts,
    coverage of every pinned input record, counts that add up, and the openai/ files (what the
    parts render to). Each part is read once."""
    store = get_store(output_uri)
    with _readable(join(output_uri, MANIFEST)):
        output_manifest = json.loads(store.get_bytes(join(output_uri, MANIFEST)))
    if not store.exists(join(output_uri, SUCCESS)):
        raise VerificationError(f"{join(output_uri, SUCCESS)} is missing")
    _no_unlisted_parts(output_uri, output_manifest)
    c = output_manifest["counts"]
    if c["records_succeeded"] + c["records_failed"] != c["records_total"]:
        raise VerificationError(f"counts do not add up: {c}")
    rendered = _openai_files(output_manifest) if "openai" in output_manifest else {}
    coverage = Coverage(output_manifest["inputs"])
    with tempfile.TemporaryDirectory() as tmp:
        for p in (q for q in output_manifest["parts"] if q["kind"] not in PARQUET_KINDS and q["kind"] != "openai"):
            uri = join(output_uri, p["key"])
            with _readable(uri):
                got_sha = hashlib.sha256(store.get_bytes(uri)).hexdigest()
            if got_sha != p["sha256"]:
                raise VerificationError(f"{p['key']}: sha256 {got_sha[:12]}…, manifest says {p['sha256'][:12]}…")
        for p in (q for q in output_manifest["parts"] if q["kind"] in PARQUET_KINDS):
            with read_part(join(output_uri, p["key"]), COVERAGE_COLUMNS) as got:
                if (got.sha256, got.rows) != (p["sha256"], p["rows"]):
                    raise VerificationError(f"{p['key']}: sha256 {got.sha256[:12]}… / {got.rows} rows, manifest "
                                            f"says {p['sha256'][:12]}… / {p['rows']}")
                coverage.add(join(output_uri, p["key"]), p["kind"], got.table)
                if p["key"] in rendered:
                    _verify_rendered(output_uri, rendered[p["key"]], got.path, p["kind"],
                                     RenderContext(**output_manifest["openai"]), tmp)
        coverage.check()
    for f in output_manifest.get("files", []):
        with _readable(join(output_uri, f["key"])):
            got = hashlib.sha256(store.get_bytes(join(output_uri, f["key"]))).hexdigest()
        if got != f["sha256"]:
            raise VerificationError(f"{f['key']} ({f['kind']} of record {f.get('record_id')!r}): sha256 {got[:12]}…, "
                                    f"manifest says {f['sha256'][:12]}…")
    return {"ok": True, "output_uri": output_uri, "parts": len(output_manifest["parts"]), "counts": c,
            **({"files": len(output_manifest["files"])} if output_manifest.get("files") else {})}


def _no_unlisted_parts(output_uri: str, output_manifest: dict[str, Any]) -> None:
    """Nothing beside the listed parts looks like a part: a `part-*` file, or a file under
    `errors/` or `openai/`, that the manifest does not list was not published by this job; nor
    is a file under a folder of its listed `files` (images/) that they do not list."""
    listed = {p["key"] for p in output_manifest["parts"]}
    files = {f["key"] for f in output_manifest.get("files", [])}
    folders = tuple({k.split("/")[0] + "/" for k in files if "/" in k})      # images/
    base = normalize_uri(output_uri).rstrip("/") + "/"
    for pin in get_store(base).list(base):
        key = pin.uri[len(base):] if pin.uri.startswith(base) else pin.uri
        if key.startswith("_work/") or key in listed or key in files:
            continue
        if folders and key.startswith(folders):
            raise VerificationError(f"{join(output_uri, key)} is not listed in {MANIFEST} `files`: it was not "
                                    f"published by job {output_manifest.get('job_id')}; remove it, or re-run the job "
                                    "to a new output")
        if key.split("/")[-1].startswith("part-") or key.startswith(("errors/", "openai/")):
            raise VerificationError(f"{join(output_uri, key)} is not listed in {MANIFEST}: it was not published by "
                                    f"job {output_manifest.get('job_id')}; remove it, or re-run the job to a new output")


def _openai_files(output_manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The openai/ files by the Parquet part each renders, checked to correspond one to one to
    the parts and to hold one line per input record."""
    rendered = [p for p in output_manifest["parts"] if p["kind"] == "openai"]
    parquet = [p["key"] for p in output_manifest["parts"] if p["kind"] in PARQUET_KINDS]
    if sorted(p["from"] for p in rendered) != sorted(parquet):
        raise VerificationError("openai/ files do not correspond one to one to the Parquet parts")
    if sum(p["rows"] for p in rendered) != output_manifest["counts"]["records_total"]:
        raise VerificationError(f"openai/ files hold {sum(p['rows'] for p in rendered)} lines for "
                                f"{output_manifest['counts']['records_total']} records")
    return {p["from"]: p for p in rendered}


def _verify_rendered(output_uri: str, p: dict[str, Any], part_path: str, kind: str, ctx: RenderContext,
                     tmp: str) -> None:
    """An openai/ file's digest matches the manifest's, and it is exactly what its Parquet part
    (the local copy at `part_path`) renders to."""
    uri = join(output_uri, p["key"])
    local = os.path.join(tmp, p["key"].replace("/", "_"))
    with _readable(uri):
        get_store(output_uri).download_file(uri, local)
    if sha256_file(local) != p["sha256"]:
        raise VerificationError(f"{p['key']}: sha256 differs from the manifest's")
    want, _ = render_to_path(part_path, kind, ctx, local + ".want")
    if want != p["sha256"]:
        raise VerificationError(f"{p['key']} is not what {p['from']} renders to")
