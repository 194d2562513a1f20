"""Plan: pin inputs, read and tokenize every record once, bucket globally by length, cut shards.

Planning is deterministic: the same pinned inputs and bundle give the same shards (ids, record
sets and staged files), so a planner that crashes is simply run again.

Staged files (under the job's work prefix):
  plan/obj-00000.parquet     one per input object: every record, tokenized or with its error
  shards/b003-00012.parquet  one per shard: the records it owns, sorted by token length
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 -- pa.compute
from batchinf import failpoints
from batchinf.bundles import open_runtime
from batchinf.errors import ManifestError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import lineage
from batchinf.ledger.events import now
from batchinf.ledger.models import Job
from batchinf.ledger.states import JobStatus, ShardStatus
from batchinf.formats import read_records
from batchinf.parts import STAGE_ROW_GROUP, read_table, write_table
from batchinf.sizing import cut_balanced, record_work, target_work
from batchinf.store import ObjectPin, get_store, join
from batchinf.submit import pin_inputs
from batchinf.tasks import get_task
from batchinf.tasks.base import STAGE_SCHEMA  # noqa: F401 -- re-exported
from batchinf.tasks.generate import GENERATE_STAGE_SCHEMA, record_params  # noqa: F401 -- re-exported

ERROR_BUCKET = -1          # shard bucket for records that failed validation: nothing to compute


@dataclass(frozen=True)
class ObjectTask:
    """One planning task: read and stage one pinned input object."""
    idx: int
    pin: ObjectPin
    fmt: str
    id_field: str
    text_field: str         # the field read as `kind`
    digest: str
    max_length: int         # text tasks: tokens kept per record; generate: the context length
    truncate: bool
    stage_uri: str
    task: str = "embed"
    kind: str = "text"      # text | prompt | messages | record (openai-batch lines say it)
    options: Any = None     # the job's options (its task's options model)
    input: Any = None       # the manifest's input section (tasks reading whole records name their fields there)


def plan_object(task: ObjectTask) -> int:
    """Read, validate and stage one object (its task tokenizes, decodes or preprocesses each
    record); write the staged table. Returns its record count."""
    failpoints.hit("plan.object")
    runtime = open_runtime(task.digest, with_model=False)
    with get_store(task.pin.uri).open_read(task.pin) as fh:
        records = read_records(fh, task.fmt, task.pin.uri, task.id_field, task.text_field,
                               kind=task.kind, task=task.task)
        table = get_task(task.task).stage(task, runtime, records)
    write_table(task.stage_uri, table)
    return table.num_rows


def bucket_bounds(lengths: np.ndarray, max_records: int, max_buckets: int = 32) -> list[int]:
    """Upper bounds (inclusive) of length buckets, from the job's own length distribution:
    quantile cut points, so each bucket holds a similar number of records, and no more buckets
    than it takes to keep shards near full (a bucket is cut into shards of max_records)."""
    if lengths.size == 0:
        return []
    n = int(min(max_buckets, max(1, -(-lengths.size // max_records))))
    qs = np.quantile(lengths, np.linspace(0, 1, n + 1)[1:], method="higher")
    return sorted({int(q) for q in qs})


def shard_id(seed: str, members: bytes = b"") -> str:
    """A shard's deterministic id: a hash of what identifies it (job, bucket, ordinal and its
    record set; or, for a split, the parent and the half)."""
    return "sh-" + hashlib.sha256(seed.encode() + members).hexdigest()[:29]


def shard_file(work_uri: str, bucket: int, ordinal: int) -> str:
    return join(work_uri, "shards", f"b{bucket + 1:03d}-{ordinal:05d}.parquet")


def cut(order: np.ndarray, tokens: np.ndarray, max_records: int, max_tokens: int) -> list[np.ndarray]:
    """Split an ordered index array into runs bounded by record count and token sum."""
    runs, start, acc = [], 0, 0
    for i, idx in enumerate(order):
        t = int(tokens[idx])
        if i > start and (i - start >= max_records or acc + t > max_tokens):
            runs.append(order[start:i])
            start, acc = i, 0
        acc += t
    if start < len(order):
        runs.append(order[start:])
    return runs


def shard_work(table: pa.Table, n_tokens: np.ndarray) -> np.ndarray:
    """Per-record work of a staged job table (a generate record also decodes its max_tokens)."""
    if "max_tokens" not in table.schema.names:
        return record_work(n_tokens)
    return record_work(n_tokens, pa.compute.fill_null(table.column("max_tokens"), 0).to_numpy())


def pin_job(job: Job) -> None:
    """submitted -> planning: pin every input object once (a second pinner changes nothing). A
    retry job pins the very objects (same versions) of the job it retries that hold its records."""
    pins = _retried_pins(job) if job.retry_of else []
    job_repo.pin(job.id, pins or pin_inputs(job))
    failpoints.hit("plan.after_pin")


def _retried_pins(job: Job) -> list[ObjectPin]:
    chosen = lineage.selection(job.id)
    return [o.pin for o in job_repo.inputs(job.retry_of or "") if chosen is None or o.pin.uri in chosen]


def object_tasks(job: Job) -> list[ObjectTask]:
    """One planning task per pinned input object."""
    m = job.manifest
    runtime = open_runtime(job.bundle_digest, with_model=False)   # verifies files + tokenizer
    if runtime.meta["task"] != m.task:
        raise ManifestError(f"bundle {m.bundle} ({job.bundle_digest[:19]}…) is a {runtime.meta['task']} "
                            f"model; this job's task is {m.task}: choose a {m.task} bundle")
    task = get_task(m.task)
    field, kind = task.read_as(m.input)
    max_length, truncate = task.limits(runtime, m.options)
    options = m.options
    return [ObjectTask(o.idx, o.pin, m.input.format, m.input.id_field, field, job.bundle_digest, max_length,
                       truncate, join(job.work_uri, "plan", f"obj-{o.idx:05d}.parquet"),
                       task=m.task, kind=kind, options=options, input=m.input)
            for o in job_repo.inputs(job.id)]


def plan_one_object(job_id: str, idx: int) -> int:
    """A planning task (one per input object, on a worker): stage one object and record its
    record count in the ledger. Does nothing once the job has left planning or the object is
    planned. Every attempt is counted before it starts and its error recorded when it raises, so
    the lifecycle can fail the job once an object has used up its attempts."""
    job = job_repo.get(job_id)
    if job.status != JobStatus.PLANNING or not job_repo.plan_attempt_started(job_id, idx):
        return 0
    try:
        n = plan_object(object_tasks(job)[idx])
    except Exception as exc:
        try:
            job_repo.plan_attempt_failed(job_id, idx, f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 -- the ledger is down too: the attempt still counts
            pass
        raise
    job_repo.object_planned(job_id, idx, n)
    return n


def finish_plan(job: Job, workers: int | None = None) -> None:
    """The global step once every object is staged: drop duplicate ids, choose bucket bounds from
    the job's own length distribution, cut shards sized by work for `workers` (the manifest's
    `shards.target_workers` wins; see `sizing`), and move the job to running."""
    m = job.manifest
    tasks = object_tasks(job)
    pins = [t.pin for t in tasks]
    counts = [o.records for o in job_repo.inputs(job.id)]

    # Global step: all records of the job, by (object, ordinal); token ids stay in Arrow.
    tables = [read_table(t.stage_uri) for t in tasks]
    table = pa.concat_tables(tables) if tables else get_task(m.task).stage_schema.empty_table()
    src = np.repeat(np.arange(len(tasks), dtype=np.int64), counts)
    ordinal = table.column("ordinal").to_numpy()
    n_tokens = table.column("n_tokens").to_numpy().astype(np.int64)
    errors = table.column("error").to_pylist()
    messages = table.column("message").to_pylist()
    ids = table.column("record_id").to_pylist()
    seen: dict[str, int] = {}
    for i, rid in enumerate(ids):        # first occurrence (in pinned order) wins
        if rid is None or errors[i] is not None:
            continue
        first = seen.setdefault(rid, i)
        if first != i:
            errors[i] = "duplicate_id"
            messages[i] = (f"{pins[src[i]].uri} record {ordinal[i]}: id {rid!r} duplicates the record at "
                           f"{pins[src[first]].uri} record {ordinal[first]}; ids must be unique in a job")
    # a retry job plans only its selected records (after the duplicate check over all of them)
    chosen = lineage.selection(job.id)
    keep = (np.ones(len(ordinal), dtype=bool) if chosen is None else
            np.array([int(o) in chosen.get(pins[s].uri, ()) for s, o in zip(src, ordinal)], dtype=bool))
    valid = np.array([e is None for e in errors], dtype=bool)
    bounds = bucket_bounds(n_tokens[valid & keep], m.shards.max_records)
    bucket = np.where(valid, np.searchsorted(np.asarray(bounds, dtype=np.int64), n_tokens), ERROR_BUCKET)

    source_uris = pa.array([p.uri for p in pins], pa.string())
    full = table.set_column(table.schema.get_field_index("error"), "error", pa.array(errors, pa.string()))
    full = full.set_column(full.schema.get_field_index("message"), "message", pa.array(messages, pa.string()))
    full = full.append_column("source", pa.DictionaryArray.from_arrays(pa.array(src, pa.int32()), source_uris))

    shard_rows = []
    work, workers = shard_work(table, n_tokens), m.shards.target_workers or workers
    target = target_work(int(work[valid & keep].sum()), workers, m.shards.max_tokens)
    for b in sorted(set(bucket[keep].tolist())):
        members = np.flatnonzero((bucket == b) & keep)
        # Within a bucket: by length, ties by (object, ordinal) -- deterministic.
        members = members[np.lexsort((ordinal[members], src[members], n_tokens[members]))]
        runs = (cut(members, n_tokens, m.shards.max_records, m.shards.max_tokens) if b == ERROR_BUCKET else
                cut_balanced(members, work, target, m.shards.max_records, m.shards.max_tokens))
        for k, run in enumerate(runs):
            uri = shard_file(job.work_uri, int(b), k)
            write_table(uri, full.take(pa.array(run)), row_group_size=STAGE_ROW_GROUP)
            key = np.ascontiguousarray(np.stack([src[run], ordinal[run]], axis=1), dtype=np.int64).tobytes()
            shard_rows.append({
                "id": shard_id(f"{job.id}|{int(b)}|{k}|", key), "job_id": job.id, "bucket": int(b), "ordinal": k,
                "status": ShardStatus.PENDING.value, "attempt": 0, "num_records": len(run),
                "num_tokens": int(n_tokens[run].sum()), "input_uri": uri, "updated_at": now()})

    plan_info = {"bucket_bounds": bounds, "max_length": tasks[0].max_length if tasks else None, "objects": len(pins),
                 "records": int(keep.sum()), "invalid": int((~valid & keep).sum()),
                 "truncated": int(np.asarray(table.column("truncated").to_numpy(zero_copy_only=False))[keep].sum()),
                 "tokens": int(n_tokens[keep].sum()), "workers": workers, "shard_work": target}
    job_repo.start_running(job.id, shard_rows, json.dumps(plan_info), int(keep.sum()),
                           now() - (job.started_at or now()))
