"""Shard sizing by work: how many shards each length bucket is cut into, and where.

A job yields enough shards for the workers that run it (`SHARDS_PER_WORKER` each, so the last
ones end close together), but no shard is cut below `min_shard_work()`, the work whose compute
keeps a shard's fixed cost (claim, staged read, part writes, commit) under ~5%. Each bucket is
cut into contiguous runs (in its length order) of equal work, within the manifest's
`shards.max_records` and `shards.max_tokens`. Work is the staged `n_tokens` column: every task's
own length measure (for generate: the prompt plus its `max_tokens`, summed per length in the
planning summaries, see planning/summary.py). The global planning step cuts groups of records of
one length (`cut_groups_balanced`), a split cuts a shard's records (`cut_balanced`).
"""

from __future__ import annotations

import math

import numpy as np

from batchinf.config import settings

SHARDS_PER_WORKER = 4


def min_shard_work() -> int:
    """BATCHINF_MIN_SHARD_TOKENS (default 10,000). Measured (docs/performance): a shard's
    fixed cost outside its compute is ~0.15-0.2 s on the 2-core dev machine and all-MiniLM-L6-v2
    computes ~2.2k tokens/s on one loaded thread, so 20x the fixed cost (<= 5% overhead) is ~4 s,
    ~9-10k tokens."""
    return settings().min_shard_tokens


def min_split_work() -> int:
    """The least remaining work for which an idle worker asks a running shard to split: a sixth
    of `min_shard_work()`. At the end of a job the choice is splitting or idling, so a split pays
    once the half it hands over computes longer than a shard's fixed cost (~0.2 s, under 1k
    tokens on one thread)."""
    return max(1, min_shard_work() // 6)


def split_bounds(work_per_token: float) -> tuple[int, int]:
    """In a shard's staged tokens (`work_per_token` from the job's plan: a generate record's work
    adds the tokens it may decode): the least remaining work worth a split, and the work left at
    which a worker counts as about to idle. The latter is two chunks: the ledger estimates what is
    left from a shard's mean tokens per record, and a last chunk may run a record past its cut."""
    return max(1, math.ceil(min_split_work() / work_per_token)), int(2 * split_chunk_work() / work_per_token)


def split_chunk_work() -> int:
    """BATCHINF_SPLIT_CHUNK_TOKENS (default 2048; 0: no splitting): a streaming attempt computes
    its shard in chunks of this much work (at least one batch) and may split at a chunk's end."""
    return settings().split_chunk_tokens


def target_work(total: int, workers: int | None, max_tokens: int, min_work: int | None = None) -> int:
    """Work per shard the job aims for: its total over SHARDS_PER_WORKER shards per worker, never
    below `min_work` nor above the manifest's `max_tokens`. A job too small for that many is cut
    into a multiple of the workers where the minimum allows (three one-minute shards of audio on
    two workers leave one idle for a third of the job; two of 1.5 minutes do not). No worker
    count: one shard's worth of `max_tokens` (records and tokens caps alone, as before sizing by
    work), as for one worker: cutting finer would only add fixed cost."""
    if not workers or workers <= 1:
        return max(1, max_tokens)
    floor = min_shard_work() if min_work is None else min_work
    want = -(-int(total) // (workers * SHARDS_PER_WORKER))
    if want < floor and (n := int(total) // max(1, floor)) >= workers:
        want = -(-int(total) // (n - n % workers))
    return max(1, min(max_tokens, max(floor, want)))


def _runs(order: np.ndarray, cum: np.ndarray, k: int) -> list[np.ndarray]:
    """`order` cut into k contiguous runs whose work (prefix sums `cum`) is as equal as it gets."""
    goals = cum[-1] * np.arange(1, k, dtype=np.float64) / k
    j = np.searchsorted(cum, goals, side="left")           # first index reaching the goal
    below = np.where(j > 0, cum[np.maximum(j - 1, 0)], 0)
    cuts = np.where(goals - below < cum[j] - goals, j, j + 1)   # cut before or after it, the nearer
    cuts = np.unique(np.clip(cuts, 1, len(order) - 1))
    return [r for r in np.split(order, cuts) if len(r)]


def cut_balanced(order: np.ndarray, work: np.ndarray, target: int, max_records: int, max_tokens: int,
                 min_work: int | None = None) -> list[np.ndarray]:
    """Cut one bucket's ordered record indexes into runs of equal work: about `target` each (fewer
    rather than runs under `min_work`), and as many more as `max_records` / `max_tokens` need
    (one record alone may exceed max_tokens, as it always could)."""
    n = len(order)
    if n == 0:
        return []
    w = work[order].astype(np.int64)
    cum = np.cumsum(w)
    total = int(cum[-1])
    min_work = min_shard_work() if min_work is None else min_work
    k = min(-(-total // max(1, target)), max(1, total // max(1, min(min_work, target))))
    k = max(1, k, -(-n // max_records), -(-total // max(1, max_tokens)))
    while k < n:
        runs = _runs(order, cum, k)
        if all(len(r) <= max_records and (len(r) == 1 or int(work[r].sum()) <= max_tokens) for r in runs):
            return runs
        k += max(1, k // 8)
    return [order[i:i + 1] for i in range(n)]


Group = tuple[int, int, int]        # (object, token length, records): records of one length, in order


def _group_cuts(cum: np.ndarray, starts: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """`_runs`'s cut positions (records before each cut) over groups whose records share one
    work each: group g's record work is its work over its count (`cum`: the groups' prefix sums)."""
    total = float(cum[-1])
    goals = total * np.arange(1, k, dtype=np.float64) / k
    g = np.minimum(np.searchsorted(cum, goals, side="left"), len(cum) - 1)   # group reaching the goal
    before = np.where(g > 0, cum[np.maximum(g - 1, 0)], 0.0)
    per = (cum[g] - before) / counts[g]
    with np.errstate(divide="ignore", invalid="ignore"):
        j = np.where(per > 0, np.ceil((goals - before) / np.where(per > 0, per, 1)) - 1, counts[g] - 1)
    j = np.clip(j, 0, counts[g] - 1)
    below, at = before + j * per, before + (j + 1) * per
    inside = np.where(goals - below < at - goals, j, j + 1)   # cut before or after it, the nearer
    return (starts[g] + inside).astype(np.int64)


def _slices(counts: list[int], cuts: list[int]) -> list[list[tuple[int, int]]]:
    """(group index, records) runs of the ordered groups split at these record positions
    (ascending, inside (0, n))."""
    runs: list[list[tuple[int, int]]] = [[]]
    pos, c_i = 0, 0
    for g, c in enumerate(counts):
        while c:
            edge = cuts[c_i] if c_i < len(cuts) else pos + c
            take = min(c, edge - pos)
            runs[-1].append((g, take))
            pos, c = pos + take, c - take
            if c_i < len(cuts) and pos == cuts[c_i]:
                runs.append([])
                c_i += 1
    return [r for r in runs if r]


def cut_groups_balanced(groups: list[Group], work: list[int], target: int, max_records: int, max_tokens: int,
                        min_work: int | None = None) -> list[list[Group]]:
    """`cut_balanced` over runs of equal-length records (`work`: each group's, shared equally by
    its records): k runs of equal work, k chosen exactly as `cut_balanced` chooses it and raised
    while a run breaks the caps, groups split at record counts. Empty groups are dropped."""
    groups, work = [g for g in groups if g[2] > 0], [w for g, w in zip(groups, work) if g[2] > 0]
    counts = np.array([c for _, _, c in groups], dtype=np.int64)
    n = int(counts.sum())
    if n == 0:
        return []
    w = np.asarray(work, dtype=np.float64)
    cum, starts = np.cumsum(w), np.concatenate([[0], np.cumsum(counts)[:-1]])
    per = w / counts
    total = int(sum(work))
    min_work = min_shard_work() if min_work is None else min_work
    k = min(-(-total // max(1, target)), max(1, total // max(1, min(min_work, target))))
    k = max(1, k, -(-n // max_records), -(-total // max(1, max_tokens)))
    while k < n:
        cuts = np.unique(np.clip(_group_cuts(cum, starts, counts, k), 1, n - 1)).tolist()
        runs = _slices(counts.tolist(), cuts)
        sizes = [sum(c for _, c in r) for r in runs]
        if all(m <= max_records and (m == 1 or sum(c * per[g] for g, c in r) <= max_tokens + 1e-6)
               for m, r in zip(sizes, runs)):
            return [[(groups[g][0], groups[g][1], c) for g, c in r] for r in runs]
        k += max(1, k // 8)
    return [[(o, length, 1)] for o, length, c in groups for _ in range(c)]
