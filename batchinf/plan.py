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
from typing import Any, Iterator

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
from batchinf.manifest import GenerateOptions
from batchinf.formats import InputRecord, read_records
from batchinf.parts import STAGE_ROW_GROUP, read_table, write_table
from batchinf.store import ObjectPin, get_store, join
from batchinf.submit import pin_inputs

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
    from batchinf.runtime.sampling import derive_seed

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


def pin_job(job: Job) -> None:
    """submitted -> planning: pin every input object once (a second pinner changes nothing). A
    retry job pins the very objects (same versions) of the job it retries that hold its records."""
    pins = _retried_pins(job) if job.retry_of else []
    job_repo.pin(job.id, pins or pin_inputs(job.manifest))
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
    field, kind = m.input.value_field(m.task)
    if isinstance(m.options, GenerateOptions):
        max_length, truncate, options = runtime.context_length, False, m.options
    else:
        limit = runtime.meta["max_length"]
        max_length, truncate, options = min(m.options.max_length or limit, limit), m.options.truncate, None
    return [ObjectTask(o.idx, o.pin, m.input.format, m.input.id_field, field, job.bundle_digest, max_length,
                       truncate, join(job.work_uri, "plan", f"obj-{o.idx:05d}.parquet"),
                       task=m.task, kind=kind, options=options)
            for o in job_repo.inputs(job.id)]


def plan_one_object(job_id: str, idx: int) -> int:
    """A planning task (one per input object, on a worker): stage one object and record its
    record count in the ledger. Does nothing once the job has left planning."""
    job = job_repo.get(job_id)
    if job.status != JobStatus.PLANNING:
        return 0
    n = plan_object(object_tasks(job)[idx])
    job_repo.object_planned(job_id, idx, n)
    return n


def finish_plan(job: Job) -> None:
    """The global step once every object is staged: drop duplicate ids, choose bucket bounds from
    the job's own length distribution, cut shards, and move the job to running."""
    m = job.manifest
    tasks = object_tasks(job)
    pins = [t.pin for t in tasks]
    counts = [o.records for o in job_repo.inputs(job.id)]

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
    for b in sorted(set(bucket[keep].tolist())):
        members = np.flatnonzero((bucket == b) & keep)
        # Within a bucket: by length, ties by (object, ordinal) -- deterministic.
        members = members[np.lexsort((ordinal[members], src[members], n_tokens[members]))]
        for k, run in enumerate(cut(members, n_tokens, m.shards.max_records, m.shards.max_tokens)):
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
                 "tokens": int(n_tokens[keep].sum())}
    job_repo.start_running(job.id, shard_rows, json.dumps(plan_info), int(keep.sum()),
                           now() - (job.started_at or now()))
