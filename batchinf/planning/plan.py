"""Plan: pin inputs, read and tokenize every record once, bucket globally by length, cut shards.

Planning is deterministic: the same pinned inputs and bundle give the same shards (ids, record
sets and staged files), so a planner that crashes is simply run again.

Staged files (under the job's work prefix):
  plan/obj-00000.parquet     one per input object: every record, tokenized or with its error
  plan/obj-00001.p0003.parquet  one per part of an object planned in parts (planning/ranges.py)
  shards/b003-00012.parquet  one per shard: the records it owns, sorted by token length
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from contextlib import ExitStack
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 -- pa.compute
from batchinf import failpoints
from batchinf.planning import bucketing
from batchinf.planning import ranges
from batchinf.bundles import open_runtime
from batchinf.errors import InputError, ManifestError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import lineage
from batchinf.ledger.events import now
from batchinf.ledger.models import Job
from batchinf.ledger.states import JobStatus, ShardStatus
from batchinf.formats import read_records
from batchinf.parts import STAGE_ROW_GROUP, write_table
from batchinf.planning.ranges import Part, combined, part_records, renumber
from batchinf.planning.summary import (IDS_ROW_GROUP, ids_uri, in_stage_order, read_summary, summarize, summary_uri,
                                   valid_ids, write_summary)
from batchinf.planning.sizing import target_work
from batchinf.store import ObjectPin, get_store, join
from batchinf.planning.pin import pin_again, pin_inputs
from batchinf.scopes import Storage
from batchinf.tasks import get_task
from batchinf.tasks.base import STAGE_SCHEMA  # noqa: F401 -- re-exported
from batchinf.tasks.batching import token_budget_batches
from batchinf.tasks.generate import GENERATE_STAGE_SCHEMA, record_params  # noqa: F401 -- re-exported

ERROR_BUCKET = bucketing.ERROR_BUCKET   # shard bucket for records that failed validation: nothing to compute


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
    may_read: Callable[[str], None] | None = None   # raises for an object a record names (image URIs) that
                                                     # the job may not read (a confined job: outside its grants)
    splittable: bool = True     # False: planned whole whatever its size (a retry job plans chosen ordinals)
    part: Part | None = None    # the part of the object this task plans (planning/ranges.py); None: all of it


def part_tasks(task: ObjectTask) -> list[ObjectTask]:
    """The object's planning tasks: one per part when it is planned in parts, else itself."""
    parts = ranges.object_parts(task.pin, task.fmt, task.splittable)
    if parts is None:
        return [task]
    return [replace(task, part=p, stage_uri=ranges.part_uri(task.stage_uri, p)) for p in parts]


def plan_object(task: ObjectTask, keep: set[int] | None = None) -> int:
    """Read, validate and stage one object or part (its task tokenizes, decodes or preprocesses
    each record); write the staged table (by length, then ordinal), its sorted ids and its summary
    (planning/summary.py; `keep`: the ordinals a retry job plans; a part's line and record counts).
    Returns its record count."""
    failpoints.hit("plan.object")
    runtime = open_runtime(task.digest, with_model=False)
    tally: dict[str, int] = {}
    with ExitStack() as stack:
        if task.part is None:
            fh = stack.enter_context(get_store(task.pin.uri).open_read(task.pin))
            records = read_records(fh, task.fmt, task.pin.uri, task.id_field, task.text_field,
                                   kind=task.kind, task=task.task)
        else:
            records = part_records(task, tally)
        table = in_stage_order(get_task(task.task).stage(task, runtime, records))
    # row groups of STAGE_ROW_GROUP: the global step's cursors hold one at a time, not the whole part
    write_table(task.stage_uri, table, row_group_size=STAGE_ROW_GROUP)
    ids = valid_ids(table)
    write_table(ids_uri(task.stage_uri), ids, row_group_size=IDS_ROW_GROUP)
    summary = summarize(table, keep, ids)
    if task.part is not None:
        summary["part"] = {"number": task.part.number, "start": task.part.start, "stop": task.part.stop, **tally}
    write_summary(task.stage_uri, summary)      # last: the object (part) is staged
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


def pin_job(job: Job) -> None:
    """submitted -> planning: pin every input object once (a second pinner changes nothing). A
    retry job pins the very objects (same versions) of the job it retries that hold its records."""
    pins = pin_again(job, _retried_pins(job)) if job.retry_of else []
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
                       task=m.task, kind=kind, options=options, input=m.input,
                       may_read=Storage(job.tenant, job.confined).checker("object"),
                       splittable=not job.retry_of)
            for o in job_repo.inputs(job.id)]


def plan_one_object(job_id: str, idx: int, send_parts: Callable[[list[int]], None] | None = None) -> int:
    """A planning task (one per input object, on a worker): stage one object (all its parts, in
    order) and record its record count in the ledger. Does nothing once the job has left planning
    or the object is planned. Every attempt is counted before it starts and its error recorded
    when it raises, so the lifecycle can fail the job once an object has used up its attempts.
    With `send_parts` (a broker's), an object of several parts sends those not staged yet as
    tasks of their own instead (`plan_sent_part`; the attempt lasts until the last is staged)."""
    job = job_repo.get(job_id)
    if job.status != JobStatus.PLANNING:
        return 0
    task = object_tasks(job)[idx]
    tasks = begin_object(job, task)
    if tasks is None:
        return 0
    if send_parts is None or len(tasks) == 1:
        keep = _keep(task, _selection(job))
        return end_object(job_id, idx, lambda: sum(plan_object(t, keep) for t in tasks))
    missing = [k for k, t in enumerate(tasks) if not _staged(t)]
    if not missing:         # all staged by an earlier attempt whose last part was not recorded
        return end_object(job_id, idx, lambda: _staged_records(tasks)) or 0
    end_object(job_id, idx, lambda: send_parts(missing), planned=False)
    return 0


def plan_sent_part(job_id: str, idx: int, k: int) -> None:
    """A part's own planning task (distributed mode): stage part k unless it is staged; the part
    that finds every part of its object staged records the object planned. Each part that starts
    keeps the object's attempt alive (its time limit counts from the last part's start); its
    failure is the attempt's (the lifecycle sends the object again: its unstaged parts are sent)."""
    job = job_repo.get(job_id)
    if job.status != JobStatus.PLANNING:
        return
    task = object_tasks(job)[idx]
    tasks = part_tasks(task)

    def attempt() -> int | None:
        if not _staged(tasks[k]):
            job_repo.plan_part_started(job_id, idx)
            plan_object(tasks[k], _keep(task, _selection(job)))
        return _staged_records(tasks)
    end_object(job_id, idx, attempt)


def _staged(task: ObjectTask) -> bool:
    uri = summary_uri(task.stage_uri)
    return get_store(uri).exists(uri)


def _staged_records(tasks: list[ObjectTask]) -> int | None:
    """The records of an object whose parts are all staged, else None (the last parts are looked
    at first: while parts are still planning, one look tells)."""
    if not all(_staged(t) for t in reversed(tasks)):
        return None
    return sum(read_summary(t.stage_uri)["rows"] for t in tasks)


def plan_objects(job: Job, idxs: list[int], processes: int) -> None:
    """Stage objects of a planning job on this machine, their parts in a pool of `processes`
    processes when there are several: each object's attempt is counted and its outcome recorded here."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    if job.status != JobStatus.PLANNING:
        return
    every, chosen = object_tasks(job), _selection(job)
    begun = [(every[i], parts) for i in idxs if (parts := begin_object(job, every[i])) is not None]
    total = sum(len(parts) for _, parts in begun)
    if processes <= 1 or total <= 1:
        for task, parts in begun:
            keep = _keep(task, chosen)
            end_object(job.id, task.idx, lambda parts=parts, keep=keep: sum(plan_object(t, keep) for t in parts))
        return
    errors = []
    n = min(total, processes)
    with ProcessPoolExecutor(n, mp_context=mp.get_context("spawn"), initializer=tokenizer_threads,
                             initargs=(max(1, (os.cpu_count() or 1) // n),)) as pool:
        futures = [(task, [pool.submit(plan_object, t, _keep(task, chosen)) for t in parts])
                   for task, parts in begun]
        for task, fs in futures:
            try:
                end_object(job.id, task.idx, partial(_results, fs))
            except Exception as exc:  # noqa: BLE001 -- recorded for its object; the first is raised below
                errors.append(exc)
    if errors:
        raise errors[0]


def tokenizer_threads(threads: int) -> None:
    """A planning pool process's initializer: the tokenizer's thread pool (built at its first
    batch, from RAYON_NUM_THREADS) gets this process's share of the cores, so that N planning
    processes do not each start one thread per core."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)


def _results(futures: list[Future]) -> int:
    return sum(f.result() for f in futures)


def begin_object(job: Job, task: ObjectTask) -> list[ObjectTask] | None:
    """Count a planning attempt of the object (`task`, of the planning `job`); its planning
    parts' tasks, or None when it is planned already."""
    if not job_repo.plan_attempt_started(job.id, task.idx):
        return None
    return end_object(job.id, task.idx, lambda: part_tasks(task), planned=False)


def _selection(job: Job) -> dict[str, set[int]] | None:
    """The records a retry job plans, by object (`lineage.selection`); None: every record."""
    return lineage.selection(job.id)


def _keep(task: ObjectTask, chosen: dict[str, set[int]] | None) -> set[int] | None:
    """The ordinals of the object that `chosen` (a `_selection`) plans; None: every one."""
    return None if chosen is None else chosen.get(task.pin.uri, set())


def end_object(job_id: str, idx: int, attempt: Callable[[], Any], planned: bool = True) -> Any:
    """Run (or wait for) the object's attempt: record its error when it raises, else (`planned`)
    its record count, unless it returns None (parts of the object are still planning)."""
    try:
        n = attempt()
    except Exception as exc:
        try:
            job_repo.plan_attempt_failed(job_id, idx, f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 -- the ledger is down too: the attempt still counts
            pass
        raise
    if planned and n is not None:
        job_repo.object_planned(job_id, idx, n)
    return n


def finish_plan(job: Job, workers: int | None = None) -> None:
    """The global step once every object is staged, over the objects' summaries only
    (bucketing.py): drop duplicate ids, choose bucket bounds from the job's own length histogram,
    cut shards as slices of staged objects (sized by work for `workers`, the manifest's
    `shards.target_workers` winning; see sizing.py), write each shard's file from its slices, and move the
    job to running (a held job: planned)."""
    m = job.manifest
    tasks = object_tasks(job)
    uris = [t.pin.uri for t in tasks]
    # a retry job plans only its selected records (after the duplicate check over all of them)
    chosen = lineage.selection(job.id)
    keeps = [None if chosen is None else chosen.get(u, set()) for u in uris]
    st = _Staged.read(tasks, keeps)
    summaries = st.objects(len(tasks))
    with ExitStack() as stack:
        part_dups = bucketing.find_duplicates(bucketing.ids_paths(stack, st.uris), st.summaries,
                                              [uris[o] for o in st.owner], [b[0] for b in st.bases])
    dups: bucketing.Dups = {}
    for p, mine in part_dups.items():
        dups.setdefault(st.owner[p], {}).update(mine)
    valid, invalid, by_code = bucketing.merge(summaries, keeps, dups)
    merged: Counter[int] = Counter()
    for h in valid:
        merged.update(h)
    bounds = bucketing.bounds_from_histogram(merged, m.shards.max_records)
    extra = bucketing.extra_work(summaries, valid)
    workers = m.shards.target_workers or workers
    prompt_work, decode_work = sum(L * c for L, c in merged.items()), sum(sum(e.values()) for e in extra)
    target = target_work(prompt_work + decode_work, workers, m.shards.max_tokens)
    planned = bucketing.cut_all(bounds, valid, invalid, m.shards.max_records, m.shards.max_tokens,
                                target if workers and workers > 1 else None, extra)

    source_uris = pa.array(uris, pa.string())
    shard_rows, padded = [], 0
    with ExitStack() as stack:
        readers = st.readers(bucketing.local_paths(stack, st.uris), uris, part_dups)
        for sh in planned:
            table = bucketing.shard_table(sh, readers[sh.bucket == ERROR_BUCKET], source_uris)
            lengths = np.repeat([L for _, L, _ in sh.slices], [k for _, _, k in sh.slices]).astype(np.int64)
            padded += padded_tokens(lengths, getattr(m.options, "max_batch_tokens", None))
            uri = shard_file(job.work_uri, sh.bucket, sh.ordinal)
            write_table(uri, table, row_group_size=STAGE_ROW_GROUP)
            src = table.column("source").combine_chunks().indices.to_numpy().astype(np.int64)
            key = np.ascontiguousarray(np.stack([src, table.column("ordinal").to_numpy()], axis=1),
                                       dtype=np.int64).tobytes()
            shard_rows.append({
                "id": shard_id(f"{job.id}|{sh.bucket}|{sh.ordinal}|", key), "job_id": job.id, "bucket": sh.bucket,
                "ordinal": sh.ordinal, "status": ShardStatus.PENDING.value, "attempt": 0,
                "num_records": table.num_rows, "num_tokens": int(lengths.sum()), "input_uri": uri,
                "updated_at": now()})

    records = sum(s["records"] for s in summaries)
    plan_info = {"bucket_bounds": bounds, "max_length": tasks[0].max_length if tasks else None, "objects": len(uris),
                 "records": records, "invalid": sum(by_code.values()),
                 "truncated": sum(s["truncated"] for s in summaries),
                 "tokens": sum(s["tokens"] for s in summaries), "padded_tokens": padded,
                 "workers": workers, "shard_work": target,
                 # work per staged token (generate: its decoding too), for sizing a split by num_tokens
                 **({"work_per_token": round((prompt_work + decode_work) / prompt_work, 4)}
                    if decode_work and prompt_work else {}),
                 "invalid_by_code": dict(sorted(by_code.items())),
                 "buckets": [{"bucket": b, "max_tokens": bound,
                              "records": sum(c for L, c in merged.items() if lo <= L <= bound),
                              "tokens": sum(L * c for L, c in merged.items() if lo <= L <= bound)}
                             for b, (lo, bound) in enumerate(zip([0] + [x + 1 for x in bounds], bounds))]}
    job_repo.start_running(job.id, shard_rows, json.dumps(plan_info), records,
                           now() - (job.started_at or now()), hold=job.hold)


def _part_summary(task: ObjectTask) -> dict[str, Any]:
    """The staged object's (or part's) summary, checked to be of the part this planner expects."""
    try:
        s = read_summary(task.stage_uri)
    except InputError:
        s = None
    if s is None or (s.get("part") or {}).get("number") != (task.part.number if task.part else None):
        raise bucketing.StagedMismatch(
            f"{task.pin.uri} was staged in other parts than this planner cuts (is BATCHINF_PLAN_RANGE_BYTES "
            f"the same for every planner?): no summary {summary_uri(task.stage_uri)}; give every planner one "
            "setting and plan the job again")
    return s


@dataclass
class _Staged:
    """The staged planning parts of a job's objects (one per object planned whole), in order."""
    owner: list[int]                    # part -> its object
    uris: list[str]                     # staged files
    summaries: list[dict[str, Any]]
    keeps: list[set[int] | None]
    bases: list[tuple[int, int]]        # (records, lines) before each part in its object

    @classmethod
    def read(cls, tasks: list[ObjectTask], keeps: list[set[int] | None]) -> _Staged:
        parts = [(o, p) for o, t in enumerate(tasks) for p in part_tasks(t)]
        summaries = [_part_summary(p) for _, p in parts]
        owner = [o for o, _ in parts]
        return cls(owner, [p.stage_uri for _, p in parts], summaries, [keeps[o] for o in owner],
                   ranges.shifts(summaries, owner))

    def objects(self, n: int) -> list[dict[str, Any]]:
        """Each object's summary, its parts' added up."""
        return [combined([s for s, o in zip(self.summaries, self.owner) if o == i]) for i in range(n)]

    def readers(self, paths: list[str], uris: list[str], dups: bucketing.Dups) -> dict[bool, list[bucketing.PartsCursor]]:
        """Per kind (invalid or not), one cursor per object over its parts' rows, renumbered."""
        shifts = [partial(renumber, uri=uris[o], records=r, lines=n) for o, (r, n) in zip(self.owner, self.bases)]
        valid, invalid, _ = bucketing.merge(self.summaries, self.keeps, dups)
        out = {}
        for kind, counts in ((True, invalid), (False, valid)):
            cursors = bucketing.cursors(paths, self.keeps, dups, invalid=kind, shifts=shifts)
            out[kind] = [bucketing.PartsCursor([c for c, o in zip(cursors, self.owner) if o == i],
                                               [h for h, o in zip(counts, self.owner) if o == i])
                         for i in range(max(self.owner, default=-1) + 1)]
        return out


def padded_tokens(lengths: np.ndarray, max_batch_tokens: int | None) -> int:
    """The positions one shard's forward batches will compute: its records sorted by length in
    the executor's token-budget batches (each padded to its longest), or, for a task without a
    token budget (generate), every record padded to the shard's longest -- an upper bound."""
    lengths = np.sort(np.asarray(lengths, dtype=np.int64))
    if lengths.size == 0:
        return 0
    if not max_batch_tokens:
        return int(lengths.size * lengths[-1])
    as_list = lengths.tolist()
    return sum(len(b) * as_list[b[-1]] for b in token_budget_batches(as_list, max_batch_tokens))
