"""Shard sizing by work: how many shards each length bucket is cut into, and where.

A job yields enough shards for the workers that run it (`SHARDS_PER_WORKER` each, so the last
ones end close together), but no shard is cut below `min_shard_work()`, the work whose compute
keeps a shard's fixed cost (claim, staged read, part writes, commit) under ~5%. Each bucket is
cut into contiguous runs (in its length order) of equal work, within the manifest's
`shards.max_records` and `shards.max_tokens`. Work is the staged `n_tokens` column: every task's
own length measure (for generate: the prompt plus its `max_tokens`, see `record_work`).
"""

from __future__ import annotations

import numpy as np

from batchinf.config import settings

SHARDS_PER_WORKER = 4


def min_shard_work() -> int:
    """BATCHINF_MIN_SHARD_TOKENS (default 10,000). Measured (README "Performance"): a shard's
    fixed cost outside its compute is ~0.15-0.2 s on the 2-core dev machine and all-MiniLM-L6-v2
    computes ~2.2k tokens/s on one loaded thread, so 20x the fixed cost (<= 5% overhead) is ~4 s,
    ~9-10k tokens."""
    return settings().min_shard_tokens


def split_chunk_work() -> int:
    """BATCHINF_SPLIT_CHUNK_TOKENS (default 8192; 0: no splitting): a streaming attempt computes
    its shard in chunks of this much work and may split at a chunk's end."""
    return settings().split_chunk_tokens


def record_work(n_tokens: np.ndarray, max_tokens: np.ndarray | None = None) -> np.ndarray:
    """Per-record work: the staged length measure, plus the tokens a generate record may decode."""
    work = n_tokens.astype(np.int64)
    return work if max_tokens is None else work + max_tokens.astype(np.int64)


def target_work(total: int, workers: int | None, max_tokens: int, min_work: int | None = None) -> int:
    """Work per shard the job aims for: its total over SHARDS_PER_WORKER shards per worker, never
    below `min_work` nor above the manifest's `max_tokens`. No worker count: one shard's worth
    of `max_tokens` (records and tokens caps alone, as before sizing by work), as for one worker:
    cutting finer would only add fixed cost."""
    if not workers or workers <= 1:
        return max(1, max_tokens)
    want = -(-int(total) // (workers * SHARDS_PER_WORKER))
    return max(1, min(max_tokens, max(min_shard_work() if min_work is None else min_work, want)))


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
