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

import pyarrow as pa

from batchinf import failpoints
from batchinf.formats import read_records
from batchinf.ledger import jobs as job_repo
from batchinf.ledger.models import InputObject, Job
from batchinf.ledger.states import JobStatus
from batchinf.parts import STAGE_ROW_GROUP, write_scratch_table
from batchinf.planning.context import ObjectTask, Planning, group_uri, object_groups, part_count
from batchinf.planning.ranges import part_records
from batchinf.planning.summary import (IDS_ROW_GROUP, has_ids_file, ids_uri, in_stage_order, read_summary,
                                       record_count, summarize, valid_ids, with_summary)
from batchinf.store import get_store


def stage_part(planning: Planning, task: ObjectTask, keep: set[int] | None = None) -> int:
    """Read, validate and stage one object or part (its task tokenizes, decodes or preprocesses
    each record); write the staged table (by length, then ordinal) with its summary in its footer,
    and its sorted ids when they are more than the summary holds (planning/summary.py; `keep`: the
    ordinals a retry job plans; a part's line and record counts). Returns its record count."""
    table, summary = _staged_table(planning, task, keep)
    # last, its summary in its footer: the part is staged (a torn one has no footer). Row groups
    # of STAGE_ROW_GROUP: the global step's cursors hold one at a time, not the whole part
    write_scratch_table(task.stage_uri, with_summary(table, summary), row_group_size=STAGE_ROW_GROUP)
    return record_count(summary)


def stage_group(planning: Planning, tasks: list[ObjectTask], keeps: list[set[int] | None], uri: str) -> list[int]:
    """Stage a group of small objects (context.object_groups) in one file: each member's staged
    rows in turn (by length, then ordinal), the members' summaries, each with its first row
    (`offset`), in the footer; a member with more ids than its summary holds has its own ids file,
    as when it is staged alone. One write for the group, where each object alone costs one. Returns
    each member's record count."""
    tables, members, offset = [], [], 0
    for task, keep in zip(tasks, keeps):
        table, summary = _staged_table(planning, task, keep)
        summary["offset"] = offset
        offset += table.num_rows
        tables.append(table)
        members.append(summary)
    write_scratch_table(uri, with_summary(pa.concat_tables(tables), {"group": members}),
                        row_group_size=STAGE_ROW_GROUP)
    return [record_count(s) for s in members]


def _staged_table(planning: Planning, task: ObjectTask, keep: set[int] | None) -> tuple[pa.Table, dict[str, Any]]:
    """One object's (part's) staged rows in stage order and its summary; its ids file written."""
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
    return table, summary


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
    return sum(record_count(read_summary(t.stage_uri)) for t in tasks)


def plan_objects(job: Job, idxs: list[int], processes: int) -> None:
    """Stage objects of the planning `job` on this machine, their parts in a pool of `processes`
    processes when there are several: each object's attempt is counted and its outcome recorded
    here. Small objects whose whole group (context.object_groups) is to be planned are staged by
    group, one task and one file each; a group that fails is staged again object by object, so
    an object's error is its own."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    job_id = job.id
    objects = {o.idx: o for o in job_repo.inputs(job_id)}
    started = job_repo.plan_attempts_started(job_id, idxs)
    begun = [(i, end_object(job_id, i, partial(part_count, job, objects[i]), planned=False))
             for i in idxs if i in started]
    began = {i for i, _ in begun}
    groups = [[o.idx for o in g]
              for g in object_groups([objects[i] for i in sorted(objects)], job.manifest.input.format, not job.retry_of)
              if all(o.idx in began for o in g)]
    grouped = {i for g in groups for i in g}
    singles = [(i, n) for i, n in begun if i not in grouped]
    total = len(groups) + sum(n for _, n in singles)
    if processes <= 1 or total <= 1:
        planning = Planning(job) if begun else None
        for g in groups:
            _end_group(job_id, g, partial(_stage_group, planning, [objects[i] for i in g]),
                       lambda g=g: [end_object(job_id, i, partial(_stage_object, planning, objects[i])) for i in g])
        for i, _ in singles:
            end_object(job_id, i, partial(_stage_object, planning, objects[i]))
        return
    errors = []
    n = min(total, processes)
    with ProcessPoolExecutor(n, mp_context=mp.get_context("spawn"), initializer=tokenizer_threads,
                             initargs=(max(1, (os.cpu_count() or 1) // n),)) as pool:
        staged = [(g, pool.submit(plan_group, job_id, g)) for g in groups]
        futures = [(i, [pool.submit(plan_part, job_id, i, k) for k in range(n)]) for i, n in singles]

        def alone(g: list[int]) -> None:
            for i, f in [(i, pool.submit(plan_part, job_id, i, 0)) for i in g]:
                try:
                    end_object(job_id, i, f.result)
                except Exception as exc:  # noqa: BLE001 -- recorded for its object; the first is raised below
                    errors.append(exc)
        for g, f in staged:
            _end_group(job_id, g, f.result, partial(alone, g))
        for i, fs in futures:
            try:
                end_object(job_id, i, partial(_results, fs))
            except Exception as exc:  # noqa: BLE001 -- recorded for its object; the first is raised below
                errors.append(exc)
    if errors:
        raise errors[0]


def plan_group(job_id: str, idxs: list[int]) -> list[int]:
    """Stage a group of small objects (the ledger is plan_objects'): a planning pool process's task."""
    planning = _planning(job_repo.get(job_id))
    return _stage_group(planning, [job_repo.input_object(job_id, i) for i in idxs])


def _stage_group(planning: Planning, objs: list[InputObject]) -> list[int]:
    return stage_group(planning, [planning.object_task(o) for o in objs], [planning.kept(o) for o in objs],
                       group_uri(planning.job.work_uri, objs[0].idx, objs[-1].idx))


def _end_group(job_id: str, idxs: list[int], attempt: Callable[[], list[int]], alone: Callable[[], Any]) -> None:
    """Run (or wait for) a group's staging and record its objects planned in one statement; when
    it fails, stage them one by one instead (`alone`), each recording its own outcome."""
    try:
        counts = attempt()
    except Exception:  # noqa: BLE001 -- the objects are staged alone: each error is its object's
        alone()
        return
    job_repo.objects_planned(job_id, dict(zip(idxs, counts)))


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
