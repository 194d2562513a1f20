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
import os
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 -- pa.compute
from sqlalchemy import func, insert, select, update

from batchinf import failpoints
from batchinf.bundles import open_runtime
from batchinf.errors import ManifestError
from batchinf.jobs import input_pins, job_manifest, job_row, pin_inputs
from batchinf.ledger.db import tx
from batchinf.ledger.ops import now, record_event, transition_job
from batchinf.ledger.states import JobStatus, ShardStatus
from batchinf.ledger.tables import job_inputs, jobs, record_errors, shards
from batchinf.manifest import GenerateOptions
from batchinf.parts import ERROR_SCHEMA, STAGE_ROW_GROUP, read_table, write_table
from batchinf.formats import InputRecord, read_records
from batchinf.store import ObjectPin, get_store, join

ERROR_BUCKET = -1          # shard bucket for records that failed validation: nothing to compute
TOKENIZE_CHUNK = 4096

STAGE_SCHEMA = pa.schema([
    ("ordinal", pa.int64()), ("record_id", pa.string()), ("error", pa.string()),
    ("message", pa.string()), ("n_tokens", pa.int32()), ("truncated", pa.bool_()),
    ("input_ids", pa.list_(pa.int32())),
])
# task generate: input_ids are the prompt's; each record carries its own resolved sampling params,
# so a worker needs nothing but the staged shard (and a retry reads the very same params)
GENERATE_STAGE_SCHEMA = pa.schema(list(STAGE_SCHEMA) + [
    ("kind", pa.string()),                      # chat | completion
    ("max_tokens", pa.int32()), ("temperature", pa.float64()), ("top_k", pa.int32()),
    ("top_p", pa.float64()), ("seed", pa.int64()), ("stop", pa.list_(pa.string())),
    ("stop_token_ids", pa.list_(pa.int32())),
])


@dataclass(frozen=True)
class ObjectTask:
    """One planning task: read and tokenize one pinned input object."""
    idx: int
    pin: ObjectPin
    fmt: str
    id_field: str
    text_field: str         # the field read as `kind`
    digest: str
    max_length: int         # embed: tokens kept per record; generate: the context length
    truncate: bool
    stage_uri: str
    task: str = "embed"
    kind: str = "text"      # text | prompt | messages (jsonl/parquet; openai-batch lines say it)
    options: GenerateOptions | None = None


def plan_object(task: ObjectTask) -> int:
    """Read, validate and tokenize one object; stage the result. Returns its record count."""
    runtime = open_runtime(task.digest, with_model=False)
    with get_store(task.pin.uri).open_read(task.pin) as fh:
        records = read_records(fh, task.fmt, task.pin.uri, task.id_field, task.text_field,
                               kind=task.kind, task=task.task)
        table = (_stage_generate(task, runtime, records) if task.task == "generate"
                 else _stage_embed(task, runtime, records))
    write_table(task.stage_uri, table)
    return table.num_rows


def _stage_embed(task: ObjectTask, runtime: Any, records: Iterator[InputRecord]) -> pa.Table:
    tok = runtime.tokenizer
    if task.max_length != tok.max_length:
        from batchinf.runtime.tokenizer import TextTokenizer

        tok = TextTokenizer.from_file(runtime.root / "tokenizer.json", task.max_length)
    cols: dict[str, list[Any]] = {name: [] for name in STAGE_SCHEMA.names}

    def flush(batch: list) -> None:
        valid = [r for r in batch if r.error is None]
        encoded = iter(tok.encode_batch([r.text for r in valid]))
        for r in batch:
            e = next(encoded) if r.error is None else None
            error, message = r.error, r.message
            if e is not None and e.truncated and not task.truncate:
                error, message = "too_long", (f"{task.pin.uri} record {r.record_id!r} is longer than "
                                              f"max_length {task.max_length} tokens; set "
                                              "options.truncate: true to truncate it")
            ok = error is None
            cols["ordinal"].append(r.ordinal)
            cols["record_id"].append(r.record_id)
            cols["error"].append(error)
            cols["message"].append(message)
            cols["n_tokens"].append(len(e.ids) if ok else 0)
            cols["truncated"].append(bool(e.truncated) if ok else False)
            cols["input_ids"].append(e.ids if ok else None)

    batch: list = []
    for rec in records:
        batch.append(rec)
        if len(batch) >= TOKENIZE_CHUNK:
            flush(batch)
            batch = []
    flush(batch)
    return pa.table(cols, schema=STAGE_SCHEMA)


def record_params(opts: GenerateOptions, record_id: str, over: dict[str, Any] | None) -> dict[str, Any]:
    """A record's sampling params: the job's options, overridden by the record's own (an
    openai-batch body). The seed is the body's if it gives one (same seed, same answer, as
    OpenAI promises), else derived from the job seed and the record id."""
    from batchinf.runtime.generate import derive_seed

    over = over or {}
    return {"max_tokens": over.get("max_tokens", opts.max_tokens),
            "temperature": over.get("temperature", opts.temperature),
            "top_k": over.get("top_k", opts.top_k), "top_p": over.get("top_p", opts.top_p),
            "seed": over["seed"] if "seed" in over else derive_seed(opts.seed, record_id),
            "stop": list(over.get("stop", opts.stop)), "stop_token_ids": list(opts.stop_token_ids)}


def _stage_generate(task: ObjectTask, runtime: Any, records: Iterator[InputRecord]) -> pa.Table:
    """Tokenize prompts (chat messages through the bundle's chat template) and resolve each
    record's sampling params; a prompt that cannot fit becomes a `prompt_too_long` error row."""
    opts = task.options or GenerateOptions()
    rows: list[dict[str, Any]] = []
    for r in records:
        row: dict[str, Any] = {"ordinal": r.ordinal, "record_id": r.record_id, "error": r.error,
                               "message": r.message, "n_tokens": 0, "truncated": False}
        rows.append(row)
        if r.error is not None:
            continue
        where = f"{task.pin.uri} record {r.record_id!r}"
        try:
            ids = runtime.encode_chat(r.messages) if r.messages is not None else runtime.encode_prompt(r.text)
        except Exception as exc:  # noqa: BLE001 -- a template that rejects a record fails that record
            row.update(error="invalid_messages" if r.messages is not None else "invalid_prompt",
                       message=f"{where}: {exc}")
            continue
        if not ids:
            row.update(error="empty_prompt", message=f"{where}: the prompt encodes to no tokens; nothing to "
                                                     "generate from")
            continue
        params = record_params(opts, r.record_id, r.params)
        need = len(ids) + params["max_tokens"]
        for limit, what, fix in (
                (task.max_length, "the bundle's context length",
                 "shorten the prompt or lower max_tokens (options.max_tokens, or the line's body.max_tokens)"),
                (opts.max_batch_tokens, "options.max_batch_tokens (the KV-cache budget)",
                 "raise options.max_batch_tokens or lower max_tokens")):
            if need > limit:
                row.update(error="prompt_too_long", message=(
                    f"{where}: prompt of {len(ids)} tokens + max_tokens {params['max_tokens']} = {need} "
                    f"exceeds {what} {limit}; {fix}"))
                break
        if row["error"] is not None:
            continue
        kind = "chat" if r.messages is not None else "completion"
        row.update(n_tokens=len(ids), input_ids=ids, kind=kind, **params)
    return pa.Table.from_pylist(rows, schema=GENERATE_STAGE_SCHEMA)


def bucket_bounds(lengths: np.ndarray, max_records: int, max_buckets: int = 32) -> list[int]:
    """Upper bounds (inclusive) of length buckets, from the job's own length distribution:
    quantile cut points, so each bucket holds a similar number of records, and no more buckets
    than it takes to keep shards near full (a bucket is cut into shards of max_records)."""
    if lengths.size == 0:
        return []
    n = int(min(max_buckets, max(1, -(-lengths.size // max_records))))
    qs = np.quantile(lengths, np.linspace(0, 1, n + 1)[1:], method="higher")
    return sorted({int(q) for q in qs})


def shard_id(job_id: str, bucket: int, ordinal: int, members: np.ndarray) -> str:
    h = hashlib.sha256(f"{job_id}|{bucket}|{ordinal}|".encode())
    h.update(np.ascontiguousarray(members, dtype=np.int64).tobytes())
    return "sh-" + h.hexdigest()[:29]


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


def pin_job(job_id: str) -> None:
    """submitted -> planning: pin every input object once (a second pinner changes nothing)."""
    row = job_row(job_id)
    pins = pin_inputs(job_manifest(row))
    with tx() as conn:
        if transition_job(conn, job_id, JobStatus.PLANNING, detail={"objects": len(pins)},
                          started_at=now()):
            conn.execute(insert(job_inputs), [
                {"job_id": job_id, "idx": i, "uri": p.uri, "size": p.size, "etag": p.etag,
                 "version_id": p.version_id} for i, p in enumerate(pins)])
    failpoints.hit("plan.after_pin")


def object_tasks(job_id: str) -> list[ObjectTask]:
    row = job_row(job_id)
    m = job_manifest(row)
    runtime = open_runtime(row.bundle_digest, with_model=False)   # verifies files + tokenizer
    if runtime.meta["task"] != m.task:
        raise ManifestError(f"bundle {m.bundle} ({row.bundle_digest[:19]}…) is a {runtime.meta['task']} "
                            f"model; this job's task is {m.task}: choose a {m.task} bundle")
    field, kind = m.input.value_field(m.task)
    if isinstance(m.options, GenerateOptions):
        max_length, truncate, options = runtime.context_length, False, m.options
    else:
        limit = runtime.meta["max_length"]
        max_length, truncate, options = min(m.options.max_length or limit, limit), m.options.truncate, None
    return [ObjectTask(i, p, m.input.format, m.input.id_field, field, row.bundle_digest, max_length,
                       truncate, join(row.work_uri, "plan", f"obj-{i:05d}.parquet"),
                       task=m.task, kind=kind, options=options)
            for i, (p, _) in enumerate(input_pins(job_id))]


def plan_one_object(job_id: str, idx: int) -> int:
    """A planning task (distributed mode: one Celery task per input object): stage one object
    and record its record count in the ledger."""
    task = object_tasks(job_id)[idx]
    n = plan_object(task)
    with tx() as conn:
        conn.execute(update(job_inputs).where(job_inputs.c.job_id == job_id, job_inputs.c.idx == idx)
                     .values(records=n))
    return n


def plan_job(job_id: str, *, processes: int | None = None) -> None:
    """Embedded planning: take a job from submitted (or a crashed planning) to running, with
    the per-object tasks in a local process pool."""
    t0 = time.perf_counter()
    if job_row(job_id).status == JobStatus.SUBMITTED:
        pin_job(job_id)
    if job_row(job_id).status != JobStatus.PLANNING:
        return
    tasks = object_tasks(job_id)
    workers = min(len(tasks), processes or os.cpu_count() or 1)
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            counts = list(pool.map(plan_object, tasks))
    else:
        counts = [plan_object(t) for t in tasks]
    finish_plan(job_id, counts, started=t0)


def finish_plan(job_id: str, counts: list[int], *, started: float | None = None) -> None:
    """The global step over every staged object: drop duplicate ids, choose bucket bounds from
    the job's own length distribution, cut shards, and move the job to running."""
    row = job_row(job_id)
    m = job_manifest(row)
    tasks = object_tasks(job_id)
    pins = [t.pin for t in tasks]

    # Global step: all records of the job, by (object, ordinal); token ids stay in Arrow.
    tables = [read_table(t.stage_uri) for t in tasks]
    table = pa.concat_tables(tables) if tables else pa.table({}, schema=STAGE_SCHEMA)
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
    valid = np.array([e is None for e in errors], dtype=bool)
    bounds = bucket_bounds(n_tokens[valid], m.shards.max_records)
    bucket = np.where(valid, np.searchsorted(np.asarray(bounds, dtype=np.int64), n_tokens), ERROR_BUCKET)

    source_uris = pa.array([p.uri for p in pins], pa.string())
    full = table.set_column(table.schema.get_field_index("error"), "error", pa.array(errors, pa.string()))
    full = full.set_column(full.schema.get_field_index("message"), "message", pa.array(messages, pa.string()))
    full = full.append_column("source", pa.DictionaryArray.from_arrays(pa.array(src, pa.int32()), source_uris))

    shard_rows = []
    for b in sorted(set(bucket.tolist())):
        members = np.flatnonzero(bucket == b)
        # Within a bucket: by length, ties by (object, ordinal) -- deterministic.
        members = members[np.lexsort((ordinal[members], src[members], n_tokens[members]))]
        for k, run in enumerate(cut(members, n_tokens, m.shards.max_records, m.shards.max_tokens)):
            uri = join(row.work_uri, "shards", f"b{b + 1:03d}-{k:05d}.parquet")
            write_table(uri, full.take(pa.array(run)), row_group_size=STAGE_ROW_GROUP)
            key = np.stack([src[run], ordinal[run]], axis=1)
            shard_rows.append({
                "id": shard_id(job_id, int(b), k, key), "job_id": job_id, "bucket": int(b), "ordinal": k,
                "status": ShardStatus.PENDING.value, "attempt": 0, "num_records": len(run),
                "num_tokens": int(n_tokens[run].sum()), "input_uri": uri, "updated_at": now()})

    plan_info = {"bucket_bounds": bounds, "max_length": tasks[0].max_length if tasks else None, "objects": len(pins),
                 "records": int(len(ordinal)), "invalid": int((~valid).sum()),
                 "truncated": int(np.asarray(table.column("truncated").to_numpy(zero_copy_only=False)).sum()),
                 "tokens": int(n_tokens.sum())}
    with tx() as conn:
        if conn.execute(select(jobs.c.status).where(jobs.c.id == job_id)).scalar() != JobStatus.PLANNING:
            return   # another planner finished first
        for i, n in enumerate(counts):
            conn.execute(update(job_inputs).where(job_inputs.c.job_id == job_id, job_inputs.c.idx == i)
                         .values(records=n))
        if shard_rows:
            conn.execute(insert(shards), shard_rows)
        transition_job(conn, job_id, JobStatus.RUNNING, detail={"shards": len(shard_rows)},
                       plan=json.dumps(plan_info), records_total=int(len(ordinal)),
                       plan_seconds=(time.perf_counter() - started) if started is not None
                       else now() - (row.started_at or now()))


@contextmanager
def failing_job_on_permanent_error(job_id: str, stage: str) -> Iterator[None]:
    """Errors no retry can fix (missing input, bad bundle or manifest) fail the job with their
    message; anything else propagates so the caller retries."""
    from batchinf.errors import BundleError, InputError, StoreError
    from batchinf.ledger.ops import fail_job

    try:
        yield
    except (BundleError, InputError, ManifestError, StoreError) as exc:
        fail_job(job_id, f"{stage} failed: {exc}")


def plan_object_task(job_id: str, idx: int) -> None:
    """Distributed planning task for one input object."""
    if job_row(job_id).status == JobStatus.PLANNING:
        with failing_job_on_permanent_error(job_id, "planning"):
            plan_one_object(job_id, idx)


def plan_or_fail(job_id: str, **kw: Any) -> None:
    with failing_job_on_permanent_error(job_id, "planning"):
        plan_job(job_id, **kw)


def resolve_quarantined(job_id: str) -> int:
    """Poison isolation. A quarantined shard (every attempt killed its worker) is split into two
    child shards, recursively, until the killing record is alone; a one-record quarantined shard
    becomes a `poison` error row. Every other record still gets its result. Returns the number of
    shards resolved. Idempotent: a shard already split or recorded is skipped."""
    job = job_row(job_id)
    child = shards.alias("child")
    with tx() as conn:
        todo = conn.execute(select(shards).where(
            shards.c.job_id == job_id, shards.c.status == ShardStatus.QUARANTINED.value,
            shards.c.errors_uri.is_(None),
            ~select(child.c.id).where(child.c.parent_id == shards.c.id).exists())).all()
    for sh in todo:
        staged = read_table(sh.input_uri)
        if staged.num_rows == 1:
            _record_poison(job, sh, staged)
            continue
        with tx() as conn:
            top = conn.execute(select(func.max(shards.c.ordinal)).where(
                shards.c.job_id == job_id, shards.c.bucket == sh.bucket)).scalar()
        half = staged.num_rows // 2
        rows = []
        for k, part in enumerate((staged.slice(0, half), staged.slice(half))):
            ordinal = top + 1 + k
            uri = join(job.work_uri, "shards", f"b{sh.bucket + 1:03d}-{ordinal:05d}.parquet")
            write_table(uri, part, row_group_size=STAGE_ROW_GROUP)
            rows.append({"id": "sh-" + hashlib.sha256(f"{sh.id}|{k}".encode()).hexdigest()[:29],
                         "job_id": job_id, "bucket": sh.bucket, "ordinal": ordinal, "parent_id": sh.id,
                         "status": ShardStatus.PENDING.value, "attempt": 0, "num_records": part.num_rows,
                         "num_tokens": int(pa.compute.sum(part.column("n_tokens")).as_py() or 0),
                         "input_uri": uri, "updated_at": now()})
        with tx() as conn:
            if conn.execute(select(shards.c.id).where(shards.c.parent_id == sh.id)).first() is None:
                conn.execute(insert(shards), rows)
                record_event(conn, job_id, "shard", sh.status, None, shard_id=sh.id,
                       detail={"split_into": [r["id"] for r in rows]})
    return len(todo)


def _record_poison(job: Any, sh: Any, staged: pa.Table) -> None:
    r = staged.to_pylist()[0]
    source = staged.column("source").cast(pa.string())[0].as_py()
    row = {"record_id": r["record_id"], "source": source, "ordinal": r["ordinal"], "error": "poison",
           "message": (f"record {r['record_id']!r} ({source} record {r['ordinal']}) killed the worker "
                       f"process in each of {sh.attempt} attempts; quarantined"), "attempts": sh.attempt}
    uri = join(job.work_uri, "attempts", sh.id, "poison", "errors.parquet")
    sha = write_table(uri, pa.Table.from_pylist([row], schema=ERROR_SCHEMA))
    with tx() as conn:
        done = conn.execute(update(shards).where(shards.c.id == sh.id, shards.c.errors_uri.is_(None))
                            .values(errors_uri=uri, errors_sha256=sha, error_rows=1, output_rows=0,
                                    updated_at=now())).rowcount
        if done:
            conn.execute(insert(record_errors).values(job_id=job.id, shard_id=sh.id, **row))
            record_event(conn, job.id, "shard", sh.status, sh.status, shard_id=sh.id, detail={"poison": r["record_id"]})
