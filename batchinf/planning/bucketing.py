"""The global planning step without global memory: it merges the planning tasks' summaries
(planning/summary.py), never every record. Its memory depends on the number of objects, distinct
token lengths, one id range and one shard, not on the number of records.

- Duplicate ids: the id space is split into ranges by the objects' id samples (about
  `DEDUP_RANGE_RECORDS` ids each); per range, every object's sorted ids file is read for that
  range only (row groups outside it are skipped) and equal ids are found by sorting. The first in
  pinned order (object, ordinal) wins; the others become `duplicate_id` rows naming it.
- Bucket bounds: the quantiles of the merged length histogram (exactly the reference step's quantiles,
  tests/helpers/reference_plan.py `bucket_bounds`).
- Shards: each bucket's (length, object) groups, in (length, object) order, are cut by count
  arithmetic exactly as the reference `cut` cuts records, or, sized by work for a worker count, into
  runs of equal work as `sizing.cut_balanced` cuts records (`sizing.cut_groups_balanced`); a
  shard is a list of slices (object, length, count). Its file is written by one forward cursor
  per object over the object's staged rows, which are sorted by (length, ordinal): a shard's rows are read, no others.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinf.errors import BatchinfError
from batchinf.parts import local_copy
from batchinf.planning.summary import has_ids_file, inline_ids, without_summary
from batchinf.planning.sizing import cut_groups_balanced

DEDUP_RANGE_RECORDS = 1 << 20     # ids compared at once by the duplicate check
ERROR_BUCKET = -1



class StagedMismatch(BatchinfError):
    """A staged object disagrees with its own summary (changed or truncated after planning)."""


# object -> ordinal -> (the token lengths of the record's staged rows: one, or one per piece of a
# record staged in pieces (tasks/base.py PIECE), shortest first; message)
Dups = dict[int, dict[int, tuple[list[int], str]]]
Slice = tuple[int, int, int]                        # (object, token length, records)


def id_splits(summaries: list[dict[str, Any]], per_range: int = 0) -> list[str]:
    """Ids that split the job's id space into ranges of about `per_range` ids, from the objects'
    samples (each sampled id stands for `id_step` ids of its object)."""
    per_range = per_range or DEDUP_RANGE_RECORDS
    if sum(s["ids"] for s in summaries) <= per_range:
        return []
    samples = sorted((rid, s["id_step"]) for s in summaries for rid in s["id_sample"])
    splits, acc = [], 0
    for rid, weight in samples:
        acc += weight
        if acc >= per_range and (not splits or rid > splits[-1]):
            splits.append(rid)
            acc = 0
    return splits


def find_duplicates(ids_paths: list[str | None], summaries: list[dict[str, Any]], uris: list[str],
                    bases: list[int] | None = None) -> Dups:
    """Every record whose id an earlier record of the job (in pinned order) has, with its message.
    The staged objects may be parts of objects (planning/ranges.py): `uris` name their objects and
    `bases` shift their ordinals into their objects'."""
    out: Dups = {}
    splits = id_splits(summaries)

    def mine(t: pa.Table, o: int) -> pa.Table:
        if bases and bases[o]:
            t = t.set_column(t.schema.get_field_index("ordinal"), "ordinal",
                             pc.add(t.column("ordinal"), pa.scalar(bases[o], pa.int64())))
        return t.append_column("obj", pa.array(np.full(t.num_rows, o, dtype=np.int32)))

    # the ids of small objects are in their summaries (which the step holds anyway): one table
    inline = [mine(inline_ids(s), o) for o, s in enumerate(summaries) if s["ids"] and not has_ids_file(s)]
    held = pa.concat_tables(inline) if inline else None
    for lo, hi in zip([None, *splits], [*splits, None]):
        filters = ([("record_id", ">=", lo)] if lo is not None else []) + \
                  ([("record_id", "<", hi)] if hi is not None else [])
        parts = []
        if held is not None:
            parts.append(held.filter(pq.filters_to_expression(filters)) if filters else held)
        for o, path in enumerate(ids_paths):
            if path is None or not summaries[o]["ids"] or not has_ids_file(summaries[o]):
                continue
            parts.append(mine(pq.read_table(path, filters=filters or None), o))
        if parts:
            _duplicates_in(pa.concat_tables(parts), uris, out)
    return out


def _duplicates_in(t: pa.Table, uris: list[str], out: Dups) -> None:
    t = t.sort_by([("record_id", "ascending"), ("obj", "ascending"), ("ordinal", "ascending")])
    n = t.num_rows
    if n < 2:
        return
    ids = t.column("record_id").combine_chunks()
    same = np.zeros(n, dtype=bool)
    same[1:] = pc.equal(ids.slice(1), ids.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    dup = np.flatnonzero(same)
    if not dup.size:
        return
    first = np.maximum.accumulate(np.where(same, 0, np.arange(n)))
    obj, ordinal = t.column("obj").to_numpy(), t.column("ordinal").to_numpy()
    n_tokens = t.column("n_tokens").to_numpy()
    for p, rid in zip(dup.tolist(), ids.take(pa.array(dup)).to_pylist()):
        f = first[p]
        if (obj[p], ordinal[p]) == (obj[f], ordinal[f]):
            continue        # another piece of the first record (a record staged in pieces has one id in each)
        mine = out.setdefault(int(obj[p]), {})
        lengths = mine.get(int(ordinal[p]), ([], ""))[0]
        mine[int(ordinal[p])] = (sorted(lengths + [int(n_tokens[p])]),
                                 f"{uris[obj[p]]} record {ordinal[p]}: id {rid!r} duplicates the record at "
                                 f"{uris[obj[f]]} record {ordinal[f]}; ids must be unique in a job")


def bounds_from_histogram(hist: dict[int, int], max_records: int, max_buckets: int = 32) -> list[int]:
    """The reference `bucket_bounds` (tests/helpers/reference_plan.py) of the lengths this
    histogram counts (numpy's 'higher' quantiles: the value at sorted position ceil((n - 1) q))."""
    lengths = sorted(L for L, c in hist.items() if c > 0)
    counts = np.cumsum([hist[L] for L in lengths], dtype=np.int64)
    n = int(counts[-1]) if lengths else 0
    if n == 0:
        return []
    k = int(min(max_buckets, max(1, -(-n // max_records))))
    idx = np.ceil((n - 1) * np.linspace(0, 1, k + 1)[1:]).astype(np.intp)
    return sorted({int(lengths[p]) for p in np.searchsorted(counts, idx, side="right")})


def cut_groups(groups: list[Slice], max_records: int, max_tokens: int) -> list[list[Slice]]:
    """The reference `cut` over runs of equal-length records: a new shard when the current one holds
    max_records or the next record would pass max_tokens (a shard's first record always fits)."""
    shards: list[list[Slice]] = []
    cur: list[Slice] = []
    n = acc = 0
    for o, length, c in groups:
        while c > 0:
            if n and (n >= max_records or acc + length > max_tokens):
                shards.append(cur)
                cur, n, acc = [], 0, 0
            fit = c if length == 0 else (max_tokens - acc) // length
            k = min(c, max_records - n, max(fit, 0 if n else 1))
            cur.append((o, length, k))
            n, acc, c = n + k, acc + k * length, c - k
    if cur:
        shards.append(cur)
    return shards


def _groups(hists: list[dict[int, int]], lo: int, hi: int) -> list[Slice]:
    """(object, length, count) of lengths in [lo, hi], by length then object."""
    lengths = sorted({L for h in hists for L, c in h.items() if lo <= L <= hi and c > 0})
    return [(o, L, h[L]) for L in lengths for o, h in enumerate(hists) if h.get(L, 0) > 0]


@dataclass(frozen=True)
class PlannedShard:
    bucket: int
    ordinal: int
    slices: list[Slice]


def cut_all(bounds: list[int], valid: list[dict[int, int]], invalid: list[dict[int, int]],
            max_records: int, max_tokens: int, target: int | None = None,
            extra: list[dict[int, int]] | None = None, min_work: int | None = None) -> list[PlannedShard]:
    """Every shard of the job: the error bucket first, then each length bucket, in order. With a
    `target` work per shard (sizing.py), length buckets are cut into runs of equal work (a
    group's work: its tokens plus its `extra`, the max_tokens a generate record may decode);
    without one, and always for the error bucket, by the caps alone. `min_work`: the task's least
    work a shard holds (Task.min_shard_work; None: BATCHINF_MIN_SHARD_TOKENS)."""
    out = []
    ranges = [(ERROR_BUCKET, invalid, 0, 1 << 62)] + \
             [(b, valid, (bounds[b - 1] + 1) if b else 0, bound) for b, bound in enumerate(bounds)]
    for b, hists, lo, hi in ranges:
        groups = _groups(hists, lo, hi)
        if target is None or b == ERROR_BUCKET:
            runs = cut_groups(groups, max_records, max_tokens)
        else:
            work = [c * L + (extra[o].get(L, 0) if extra else 0) for o, L, c in groups]
            runs = cut_groups_balanced(groups, work, target, max_records, max_tokens, min_work)
        out += [PlannedShard(b, k, s) for k, s in enumerate(runs)]
    return out


def extra_work(summaries: list[dict[str, Any]], valid: list[dict[int, int]]) -> list[dict[int, int]]:
    """Per object and length, the max_tokens its kept valid records may decode (generate), scaled
    down where the duplicate check moved some of them out (they share the sum equally)."""
    out = []
    for s, hist in zip(summaries, valid):
        staged = {int(L): int(c) for L, c in s["valid"]}
        out.append({int(L): int(e) * hist.get(int(L), 0) // staged[int(L)]
                    for L, e in s.get("valid_extra", []) if staged.get(int(L))})
    return out


class Cursor:
    """Forward reader of one staged object's rows of one kind (valid or invalid), kept ones only.
    Between takes it holds only the rows it has read and not given out (less than a row group),
    not an open file: each take opens the file and reads on from the next row group, so the
    step's memory does not grow with the number of staged parts it reads side by side."""

    def __init__(self, path: str, accept: Callable[[pa.Table], np.ndarray],
                 fix: Callable[[pa.Table], pa.Table] = lambda t: t,
                 shift: Callable[[pa.Table], pa.Table] = lambda t: t,
                 window: tuple[int, int] | None = None, shared: SharedFiles | None = None) -> None:
        self.path, self.accept, self.fix, self.shift = path, accept, fix, shift
        self.window, self.shared = window, shared
        self.next_group = 0
        self.left: pa.Table | None = None

    def take(self, k: int) -> pa.Table:
        if self.window is not None and self.shared is not None:
            # a group member: its rows (a few) are read from the group's file once, for all of them
            t = self.shift(self.shared.rows(self.path, *self.window))
            self.left, self.window = self.fix(t.filter(pa.array(self.accept(t)))), None
        pieces = [] if self.left is None else [self.left]
        have = sum(p.num_rows for p in pieces)
        if have < k and self.shared is not None:
            raise StagedMismatch(f"staged object in {self.path} has fewer planned rows than its summary counts; "
                                 "plan the job again")
        if have < k:
            # without pre-buffering, reading a row group holds that row group, not the file's chunks
            with pq.ParquetFile(self.path, pre_buffer=False) as pf:
                while have < k:
                    if self.next_group >= pf.num_row_groups:
                        raise StagedMismatch(f"staged object {self.path} has fewer planned rows than its summary "
                                             "counts; plan the job again")
                    t = self.shift(without_summary(pf.read_row_group(self.next_group)))
                    self.next_group += 1
                    t = self.fix(t.filter(pa.array(self.accept(t))))
                    pieces.append(t)
                    have += t.num_rows
        rows = pa.concat_tables(pieces)
        rest = rows.num_rows - k
        # a copy of the rows left, so the row group they came from is freed (a group member's
        # rows are its own copy already)
        if not rest:
            self.left = None
        else:
            self.left = rows.slice(k) if self.shared is not None else rows.take(pa.array(np.arange(k, rows.num_rows)))
        return rows.slice(0, k)


class SharedFiles:
    """Group files (planning/stage.py `stage_group`) read once for the cursors of all their
    members: each member's first take copies its rows out; the file's rows are let go once every
    member that will take any rows has (`expect` counts them)."""

    def __init__(self) -> None:
        self.waiting: Counter[str] = Counter()
        self.tables: dict[str, pa.Table] = {}

    def expect(self, path: str) -> None:
        self.waiting[path] += 1

    def rows(self, path: str, offset: int, n: int) -> pa.Table:
        if path not in self.tables:
            self.tables[path] = without_summary(pq.read_table(path, pre_buffer=False))
        t = self.tables[path]
        self.waiting[path] -= 1
        if self.waiting[path] <= 0:
            del self.tables[path]
        return t.slice(offset, n)   # the cursor's filter copies them out: the file's rows go with the table


def cursors(paths: list[str], keeps: list[set[int] | None], dups: Dups, *, invalid: bool,
            shifts: list[Callable[[pa.Table], pa.Table]] | None = None,
            windows: list[tuple[int, int] | None] | None = None, shared: SharedFiles | None = None,
            rows: list[int] | None = None) -> list[Cursor]:
    """One cursor per object over its kept valid rows (duplicates aside) or its kept invalid ones
    (duplicates included, with their error and message: of a duplicate staged in pieces, its first
    row in stage order, its shortest, alone); `shifts` renumber each one's rows first
    (a part of an object, planning/ranges.py); `windows`: a group member's rows in its group's
    file (read through `shared`; `rows`: how many each cursor will take, none: never read)."""
    out = []
    for o, path in enumerate(paths):
        window = windows[o] if windows else None
        if window is not None and shared is not None and rows and rows[o]:
            shared.expect(path)
        mine = dups.get(o, {})
        dup_ordinals = np.fromiter(mine, dtype=np.int64, count=len(mine))
        keep = None if keeps[o] is None else np.fromiter(keeps[o], dtype=np.int64, count=len(keeps[o]))

        seen: set[int] = set()      # duplicates given out (a duplicate's other pieces are dropped)

        def accept(t: pa.Table, dup_ordinals: np.ndarray = dup_ordinals, keep: np.ndarray | None = keep,
                   seen: set[int] = seen) -> np.ndarray:
            ordinal = t.column("ordinal").to_numpy()
            bad = t.column("error").is_null().to_numpy(zero_copy_only=False) == False  # noqa: E712
            dup = np.isin(ordinal, dup_ordinals)
            bad |= dup
            ok = bad if invalid else ~bad
            if invalid and dup.any():
                for i in np.flatnonzero(dup):
                    if int(ordinal[i]) in seen:
                        ok[i] = False
                    seen.add(int(ordinal[i]))
            return ok if keep is None else ok & np.isin(ordinal, keep)

        def fix(t: pa.Table, mine: dict[int, tuple[list[int], str]] = mine) -> pa.Table:
            if not mine:
                return t
            ords = t.column("ordinal").to_pylist()
            errors, messages = t.column("error").to_pylist(), t.column("message").to_pylist()
            for i, o_ in enumerate(ords):
                if o_ in mine:
                    errors[i], messages[i] = "duplicate_id", mine[o_][1]
            t = t.set_column(t.schema.get_field_index("error"), "error", pa.array(errors, pa.string()))
            return t.set_column(t.schema.get_field_index("message"), "message", pa.array(messages, pa.string()))

        out.append(Cursor(path, accept, fix if invalid else (lambda t: t), shifts[o] if shifts else (lambda t: t),
                          window, shared if window is not None else None))
    return out


class PartsCursor:
    """Forward reader of one object's rows of one kind over the cursors of its parts: the rows of
    one length come from its parts in order (`counts[p][length]`: the part's rows of that length
    and kind), so they are the object's in (length, ordinal) order."""

    def __init__(self, parts: list[Cursor], counts: list[dict[int, int]]) -> None:
        self.parts, self.counts = parts, [dict(c) for c in counts]
        self.path = parts[0].path

    def take(self, k: int, length: int) -> pa.Table:
        if len(self.parts) == 1:
            return self.parts[0].take(k)
        pieces = []
        for cursor, left in zip(self.parts, self.counts):
            n = min(k, left.get(length, 0))
            if n:
                pieces.append(cursor.take(n))
                left[length] -= n
                k -= n
        if k:
            raise StagedMismatch(f"staged parts of {self.path} have fewer rows of length {length} than their "
                                 "summaries count; plan the job again")
        return pa.concat_tables(pieces)


def shard_table(shard: PlannedShard, readers: list[PartsCursor], source_uris: pa.Array) -> pa.Table:
    """The shard's rows, in plan order, with their `source` (a dictionary of every pinned uri)."""
    pieces = []
    for o, length, k in shard.slices:
        t = readers[o].take(k, length)
        if pc.any(pc.not_equal(t.column("n_tokens"), length)).as_py():
            raise StagedMismatch(f"staged object {readers[o].path} does not match its summary; plan the job again")
        src = pa.DictionaryArray.from_arrays(pa.array(np.full(k, o, dtype=np.int32)), source_uris)
        pieces.append(t.append_column("source", src))
    return pa.concat_tables(pieces).combine_chunks()


def merge(summaries: list[dict[str, Any]], keeps: list[set[int] | None], dups: Dups
          ) -> tuple[list[dict[int, int]], list[dict[int, int]], Counter[str]]:
    """Per-object valid and invalid length histograms and invalid counts by code, with the kept
    duplicates moved from valid to invalid (a duplicate staged in pieces: all its rows leave the
    valid ones, its shortest alone is its invalid row, `cursors`)."""
    valid = [{int(L): int(c) for L, c in s["valid"]} for s in summaries]
    invalid = [{int(L): int(c) for L, c in s["invalid"]} for s in summaries]
    by_code: Counter[str] = Counter()
    for s in summaries:
        by_code.update(s["invalid_by_code"])
    for o, mine in dups.items():
        for ordinal, (lengths, _) in mine.items():
            if keeps[o] is None or ordinal in keeps[o]:
                for length in lengths:
                    valid[o][length] -= 1
                invalid[o][lengths[0]] = invalid[o].get(lengths[0], 0) + 1
                by_code["duplicate_id"] += 1
    return valid, invalid, by_code


def local_paths(stack: ExitStack, uris: list[str]) -> list[str]:
    """Local files for these staged objects (remote ones copied to temporary files for the step,
    a group's file once for all its members)."""
    copies: dict[str, str] = {}
    for u in uris:
        if u not in copies:
            copies[u] = stack.enter_context(local_copy(u))
    return [copies[u] for u in uris]


def ids_paths(stack: ExitStack, ids_uris: list[str], summaries: list[dict[str, Any]]) -> list[str | None]:
    """Local ids files of the staged objects that have one (None: their ids are in their summary)."""
    return [stack.enter_context(local_copy(u)) if s["ids"] and has_ids_file(s) else None
            for u, s in zip(ids_uris, summaries)]

