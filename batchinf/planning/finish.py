"""The global planning step, once every object is staged (planning/stage.py): over the objects'
summaries only (bucketing.py), drop duplicate ids, choose bucket bounds from the job's own length
histogram, cut shards as slices of staged objects (sized by work, sizing.py), write each shard's
file and move the job to running in one ledger transaction.

Planning is deterministic: the same pinned inputs and bundle give the same shards (ids, record
sets and staged files), so a planner that crashes is simply run again.

  shards/b003-00012.parquet  one per shard: the records it owns, sorted by token length
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from batchinf.errors import InputError
from batchinf.ledger import jobs as job_repo
from batchinf.ledger import retry_records
from batchinf.ledger.events import now
from batchinf.ledger.models import Job
from batchinf.ledger.states import ShardStatus
from batchinf.parts import STAGE_ROW_GROUP, write_table
from batchinf.planning import bucketing, ranges
from batchinf.planning.bucketing import ERROR_BUCKET
from batchinf.planning.context import ObjectTask, Planning, group_uri, object_groups, part_tasks
from batchinf.planning.ranges import Range, combined, renumber
from batchinf.planning.shard_names import shard_file, shard_id
from batchinf.planning.sizing import target_work
from batchinf.planning.summary import has_ids_file, ids_uri, read_summary
from batchinf.store import get_store, parse_uri
from batchinf.tasks import get_task
from batchinf.tasks.batching import token_budget_batches

log = logging.getLogger("batchinf.planning")


def finish_plan(job: Job, workers: int | None = None) -> None:
    """The global step once every object is staged, over the objects' summaries only
    (bucketing.py): drop duplicate ids, choose bucket bounds from the job's own length histogram,
    cut shards as slices of staged objects (sized by work for `workers`, the manifest's
    `shards.target_workers` winning; see sizing.py), write each shard's file from its slices, and move the
    job to running (a held job: planned)."""
    m = job.manifest
    planning = Planning(job)
    tasks = planning.object_tasks()
    uris = [t.pin.uri for t in tasks]
    # a retry job plans only its selected records (after the duplicate check over all of them)
    chosen = retry_records.selection(job.id)
    keeps = [None if chosen is None else chosen.get(u, set()) for u in uris]
    st = _Staged.read(tasks, keeps, job.work_uri)
    if st.lost:
        # staged files are written without fsync (stage.py): a machine that crashed before they
        # reached its disk lost them, and planning those objects again re-creates them
        log.warning("job %s: the staged files of %d objects are lost or torn (%s, ...); planning them again",
                    job.id, len(st.lost), uris[st.lost[0]])
        job_repo.replan(job.id, st.lost, "its staged files were lost or torn (the machine crashed?); planned again")
        return
    summaries = st.objects(len(tasks))
    with ExitStack() as stack:
        part_dups = bucketing.find_duplicates(bucketing.ids_paths(stack, st.ids, st.summaries), st.summaries,
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
    task = get_task(m.task)
    floor = task.shard_floor(m.options, sum(merged.values()), prompt_work + decode_work, workers)
    target = target_work(prompt_work + decode_work, workers, m.shards.max_tokens, floor)
    planned = bucketing.cut_all(bounds, valid, invalid, m.shards.max_records, m.shards.max_tokens,
                                target if workers and workers > 1 else None, extra, floor)

    source_uris = pa.array(uris, pa.string())
    shard_rows, padded = [], 0
    progress: int | None = None     # progress units planned (Task.progress_unit)
    with ExitStack() as stack:
        readers = st.readers(bucketing.local_paths(stack, st.uris), uris, part_dups)
        for sh in planned:
            table = bucketing.shard_table(sh, readers[sh.bucket == ERROR_BUCKET], source_uris)
            lengths = np.repeat([L for _, L, _ in sh.slices], [k for _, _, k in sh.slices]).astype(np.int64)
            padded += padded_tokens(lengths, getattr(m.options, "max_batch_tokens", None))
            uri = shard_file(job.work_uri, sh.bucket, sh.ordinal)
            # durable: the shard rows start_running commits point to this file, and nothing
            # re-creates it once the job runs
            write_table(uri, table, row_group_size=STAGE_ROW_GROUP)
            if (n := task.planned_progress(table)) is not None:
                progress = (progress or 0) + n
            src = table.column("source").combine_chunks().indices.to_numpy().astype(np.int64)
            key = np.ascontiguousarray(np.stack([src, table.column("ordinal").to_numpy()], axis=1),
                                       dtype=np.int64).tobytes()
            shard_rows.append({
                "id": shard_id(f"{job.id}|{sh.bucket}|{sh.ordinal}|", key), "job_id": job.id, "bucket": sh.bucket,
                "ordinal": sh.ordinal, "status": ShardStatus.PENDING.value, "attempt": 0,
                "num_records": table.num_rows, "num_tokens": int(lengths.sum()), "input_uri": uri,
                "updated_at": now()})

    records = sum(s["records"] for s in summaries)
    # rows that continue a record staged in pieces (tasks/base.py PIECE): shards count rows, the job records
    pieces = sum(r["num_records"] for r in shard_rows) - records
    plan_info = {"bucket_bounds": bounds, "max_length": planning.max_length if tasks else None, "objects": len(uris),
                 "records": records, **({"pieces": pieces} if pieces > 0 else {}), "invalid": sum(by_code.values()),
                 "truncated": sum(s["truncated"] for s in summaries),
                 "tokens": sum(s["tokens"] for s in summaries), "padded_tokens": padded,
                 "workers": workers, "shard_work": target,
                 # work per staged token (generate: its decoding too), for sizing a split by num_tokens
                 **({"work_per_token": round((prompt_work + decode_work) / prompt_work, 4)}
                    if decode_work and prompt_work else {}),
                 "invalid_by_code": dict(sorted(by_code.items())),
                 **({task.progress_unit: progress} if progress is not None else {}),
                 "buckets": [{"bucket": b, "max_tokens": bound,
                              "records": sum(c for L, c in merged.items() if lo <= L <= bound),
                              "tokens": sum(L * c for L, c in merged.items() if lo <= L <= bound)}
                             for b, (lo, bound) in enumerate(zip([0] + [x + 1 for x in bounds], bounds))]}
    job_repo.start_running(job.id, shard_rows, json.dumps(plan_info), records,
                           now() - (job.started_at or now()), hold=job.hold)


def _part_summary(whole: ObjectTask, task: ObjectTask) -> dict[str, Any] | None:
    """The staged object's (or part's) summary, checked to be of the part this planner expects;
    None when the part's staged files are lost or torn (and the object is not staged under other
    part numbers: that is a planner cutting other parts, refused)."""
    try:
        s = read_summary(task.stage_uri)
    except InputError:
        s = None
    except ValueError:          # torn JSON
        return None
    if s is None:
        other = ranges.part_uri(whole.stage_uri, Range(0, 0, 0)) if task.part is None else whole.stage_uri
        if not get_store(other).exists(other):
            return None
    elif (s.get("part") or {}).get("number") == (task.part.number if task.part else None):
        return s if _whole(task, s) else None
    raise bucketing.StagedMismatch(
        f"{task.pin.uri} was staged in other parts than this planner cuts (is BATCHINF_PLAN_RANGE_BYTES "
        f"the same for every planner?): no staged file {task.stage_uri}; give every planner one "
        "setting and plan the job again")


def _whole(task: ObjectTask, s: dict[str, Any]) -> bool:
    """Whether a local part's ids file is whole: of the size its summary wrote down (after a crash
    a file whose data did not reach the disk is missing or short; the staged file, whose footer
    holds the summary, is whole when its footer reads; a remote store's writes are durable, as the
    staged files' need not be)."""
    scheme, _, _ = parse_uri(task.stage_uri)
    if scheme != "file" or not has_ids_file(s):
        return True
    try:
        return os.stat(parse_uri(ids_uri(task.stage_uri))[2]).st_size == s["bytes"]["ids"]
    except OSError:
        return False


def grouped_objects(tasks: list[ObjectTask], work_uri: str) -> dict[int, tuple[str, dict[str, Any]]]:
    """The objects (by position) staged in a group file (context.object_groups), whole, with its
    uri and their summaries; objects of a group without a whole file are looked for in files of their own."""
    out: dict[int, tuple[str, dict[str, Any]]] = {}
    pos = {t.idx: o for o, t in enumerate(tasks)}
    m = tasks[0] if tasks else None
    for g in object_groups(tasks, m.fmt, m.splittable) if m else []:
        uri = group_uri(work_uri, g[0].idx, g[-1].idx)
        try:
            members = read_summary(uri)["group"]
        except (InputError, ValueError, KeyError):
            continue
        if len(members) == len(g) and all(_whole(t, s) for t, s in zip(g, members)):
            out.update((pos[t.idx], (uri, s)) for t, s in zip(g, members))
    return out


@dataclass
class _Staged:
    """The staged planning parts of a job's objects (one per object planned whole), in order."""
    owner: list[int]                    # part -> its object
    uris: list[str]                     # staged files (a group's for each of its members)
    summaries: list[dict[str, Any]]
    keeps: list[set[int] | None]
    bases: list[tuple[int, int]]        # (records, lines) before each part in its object
    lost: list[int]                     # objects with a part lost or torn: to be planned again
    ids: list[str] = field(default_factory=list)    # each part's ids file (if its summary has not all its ids)
    windows: list[tuple[int, int] | None] = field(default_factory=list)   # a group member's rows in its file

    @classmethod
    def read(cls, tasks: list[ObjectTask], keeps: list[set[int] | None], work_uri: str) -> _Staged:
        grouped = grouped_objects(tasks, work_uri)
        parts = [(o, t, p) for o, t in enumerate(tasks) for p in ([t] if o in grouped else part_tasks(t))]
        found = [grouped[o][1] if o in grouped else _part_summary(t, p) for o, t, p in parts]
        lost = sorted({o for (o, _, _), s in zip(parts, found) if s is None})
        summaries = [s for s in found if s is not None]
        if lost:
            return cls([], [], summaries, [], [], lost)
        owner = [o for o, _, _ in parts]
        return cls(owner, [grouped[o][0] if o in grouped else p.stage_uri for o, _, p in parts], summaries,
                   [keeps[o] for o in owner], ranges.shifts(summaries, owner), [],
                   [ids_uri(p.stage_uri) for _, _, p in parts],
                   [(s["offset"], s["rows"]) if o in grouped else None for o, s in zip(owner, summaries)])

    def objects(self, n: int) -> list[dict[str, Any]]:
        """Each object's summary, its parts' added up."""
        by_object: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        for s, o in zip(self.summaries, self.owner):
            by_object[o].append(s)
        return [combined(parts) for parts in by_object]

    def readers(self, paths: list[str], uris: list[str], dups: bucketing.Dups) -> dict[bool, list[bucketing.PartsCursor]]:
        """Per kind (invalid or not), one cursor per object over its parts' rows, renumbered."""
        shifts = [partial(renumber, uri=uris[o], records=r, lines=n) for o, (r, n) in zip(self.owner, self.bases)]
        valid, invalid, _ = bucketing.merge(self.summaries, self.keeps, dups)
        n = max(self.owner, default=-1) + 1
        out = {}
        shared = bucketing.SharedFiles()
        for kind, counts in ((True, invalid), (False, valid)):
            cursors = bucketing.cursors(paths, self.keeps, dups, invalid=kind, shifts=shifts, windows=self.windows,
                                        shared=shared, rows=[sum(h.values()) for h in counts])
            mine: list[tuple[list[bucketing.Cursor], list[dict[int, int]]]] = [([], []) for _ in range(n)]
            for c, h, o in zip(cursors, counts, self.owner):
                mine[o][0].append(c)
                mine[o][1].append(h)
            out[kind] = [bucketing.PartsCursor(cs, hs) for cs, hs in mine]
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
