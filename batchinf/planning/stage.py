"""Stage one input object (or one part of it): read, validate and tokenize its records once, and
write what the global step (planning/finish.py) reads instead of the records. Each object is one
planning task: its attempts are counted and their errors recorded in the ledger, here, so the
lifecycle can fail the job once an object has used up its attempts.

Staged files (under the job's work prefix), per object planned whole (or per part, planning/ranges.py):
  plan/obj-00000.parquet          every record, tokenized or with its error, by (length, ordinal),
                                  its summary in the footer (planning/summary.py); written last:
                                  the object (part) is staged
  plan/obj-00000.ids.parquet      its valid ids, sorted, when they are more than the summary holds
  plan/obj-00001.p0003.parquet    ... the same for part 3 of object 1
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from contextlib import ExitStack
from functools import partial
from typing import Any, Callable

from batchinf import failpoints
from batchinf.formats import read_records
from batchinf.ledger import jobs as job_repo
from batchinf.ledger.models import InputObject, Job
from batchinf.ledger.states import JobStatus
from batchinf.parts import STAGE_ROW_GROUP, write_scratch_table
from batchinf.planning.context import ObjectTask, Planning, part_count
from batchinf.planning.ranges import part_records
from batchinf.planning.summary import (IDS_ROW_GROUP, has_ids_file, ids_uri, in_stage_order, read_summary, summarize,
                                       valid_ids, with_summary)
from batchinf.store import get_store


def stage_part(planning: Planning, task: ObjectTask, keep: set[int] | None = None) -> int:
    """Read, validate and stage one object or part (its task tokenizes, decodes or preprocesses
    each record); write the staged table (by length, then ordinal), its sorted ids and its summary
    (planning/summary.py; `keep`: the ordinals a retry job plans; a part's line and record counts).
    Returns its record count."""
    failpoints.hit("plan.object")
    tally: dict[str, int] = {}
    with ExitStack() as stack:
        if task.part is None:
            fh = stack.enter_context(get_store(task.pin.uri).open_read(task.pin))
            records = read_records(fh, task.fmt, task.pin.uri, task.id_field, task.text_field,
                                   kind=task.kind, task=task.task)
        else:
            records = part_records(task, tally)
        table = in_stage_order(planning.task.stage(task, planning.runtime, records))
    # Staged files are scratch: written without fsync (durable=False), so a small object's
    # planning task costs its tokenizing, not a disk flush. The ledger records the object
    # planned after them, yet a machine that crashes before they reach its disk loses nothing
    # that cannot be re-created from the pinned inputs: the global step finds them missing or
    # torn and plans those objects again (finish.py). What a ledger commit depends on for good,
    # with nothing to re-create it, is fsynced: the shard files start_running points to, each
    # attempt's outputs before its commit.
    ids = valid_ids(table)
    summary = summarize(table, keep, ids)
    if has_ids_file(summary):
        ids_size = write_scratch_table(ids_uri(task.stage_uri), ids, row_group_size=IDS_ROW_GROUP)
        summary["bytes"] = {"ids": ids_size}    # the global step's check that it is whole
    if task.part is not None:
        summary["part"] = {"number": task.part.number, "start": task.part.start, "stop": task.part.stop, **tally}
    # last, its summary in its footer: the part is staged (a torn one has no footer). Row groups
    # of STAGE_ROW_GROUP: the global step's cursors hold one at a time, not the whole part
    write_scratch_table(task.stage_uri, with_summary(table, summary), row_group_size=STAGE_ROW_GROUP)
    return table.num_rows


def plan_part(job_id: str, idx: int, k: int) -> int:
    """Stage part k of the object (the ledger is begin_object's and end_object's): a planning
    pool process's task, the job's planning context built once per process."""
    planning = _planning(job_repo.get(job_id))
    obj = job_repo.input_object(job_id, idx)
    return stage_part(planning, planning.part_tasks(obj)[k], planning.kept(obj))


_contexts: dict[str, Planning] = {}


def _planning(job: Job) -> Planning:
    """The job's planning context, built once per process: what it holds never changes while the
    job plans."""
    if job.id not in _contexts:
        if len(_contexts) >= 4:
            _contexts.pop(next(iter(_contexts)))
        _contexts[job.id] = Planning(job)
    return _contexts[job.id]


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
    obj = job_repo.input_object(job_id, idx)
    parts = begin_object(job, obj)
    if parts is None:
        return 0
    planning = _planning(job)
    if send_parts is None or parts == 1:
        return end_object(job_id, idx, partial(_stage_object, planning, obj))
    tasks = planning.part_tasks(obj)
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
    planning = Planning(job)
    obj = job_repo.input_object(job_id, idx)
    tasks = planning.part_tasks(obj)

    def attempt() -> int | None:
        if not _staged(tasks[k]):
            job_repo.plan_part_started(job_id, idx)
            stage_part(planning, tasks[k], planning.kept(obj))
        return _staged_records(tasks)
    end_object(job_id, idx, attempt)


def _staged(task: ObjectTask) -> bool:
    return get_store(task.stage_uri).exists(task.stage_uri)


def _staged_records(tasks: list[ObjectTask]) -> int | None:
    """The records of an object whose parts are all staged, else None (the last parts are looked
    at first: while parts are still planning, one look tells)."""
    if not all(_staged(t) for t in reversed(tasks)):
        return None
    return sum(read_summary(t.stage_uri)["rows"] for t in tasks)


def plan_objects(job: Job, idxs: list[int], processes: int) -> None:
    """Stage objects of the planning `job` on this machine, their parts in a pool of `processes`
    processes when there are several: each object's attempt is counted and its outcome recorded here."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    job_id = job.id
    objects = {o.idx: o for o in job_repo.inputs(job_id)}
    begun = [(i, n) for i in idxs if (n := begin_object(job, objects[i])) is not None]
    total = sum(n for _, n in begun)
    if processes <= 1 or total <= 1:
        planning = Planning(job) if begun else None
        for i, _ in begun:
            end_object(job_id, i, partial(_stage_object, planning, objects[i]))
        return
    errors = []
    n = min(total, processes)
    with ProcessPoolExecutor(n, mp_context=mp.get_context("spawn"), initializer=tokenizer_threads,
                             initargs=(max(1, (os.cpu_count() or 1) // n),)) as pool:
        futures = [(i, [pool.submit(plan_part, job_id, i, k) for k in range(n)]) for i, n in begun]
        for i, fs in futures:
            try:
                end_object(job_id, i, partial(_results, fs))
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


def _stage_object(planning: Planning, obj: InputObject) -> int:
    keep = planning.kept(obj)
    return sum(stage_part(planning, t, keep) for t in planning.part_tasks(obj))


def begin_object(job: Job, obj: InputObject) -> int | None:
    """Count a planning attempt of the object; its number of planning parts, or None when there
    is nothing to do (the job left planning, the object is planned)."""
    if not job_repo.plan_attempt_started(job.id, obj.idx):
        return None
    return end_object(job.id, obj.idx, lambda: part_count(job, obj), planned=False)


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
