"""Token-budget batching and global length bucketing (plan/execute hot paths)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinf.execute import token_budget_batches
from batchinf.plan import bucket_bounds, cut


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 512), min_size=1, max_size=400), st.integers(64, 8192))
def test_batches_cover_in_order_within_budget_and_fill(lengths: list[int], budget: int) -> None:
    lengths = sorted(lengths)
    batches = token_budget_batches(lengths, budget)
    assert [i for b in batches for i in b] == list(range(len(lengths)))
    for b in batches:
        padded = len(b) * max(lengths[i] for i in b)
        if len(b) > 1:
            assert padded <= budget
            assert sum(lengths[i] for i in b) >= 0.95 * padded


def test_heavy_tail_padding_efficiency_stays_high() -> None:
    rng = np.random.default_rng(0)
    lengths = sorted(np.clip(rng.lognormal(np.log(40), 1.0, 20000).astype(int), 3, 256).tolist())
    batches = token_budget_batches(lengths, 2048)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert sum(lengths) / padded >= 0.95


def test_bucket_bounds_follow_the_distribution() -> None:
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(40), 1.0, 10000).astype(int), 3, 256)
    bounds = bucket_bounds(lengths, max_records=1000)
    assert bounds == sorted(bounds) and bounds[-1] == lengths.max()
    assert len(bounds) <= 10                       # no more buckets than it takes to fill shards
    counts = np.bincount(np.searchsorted(bounds, lengths), minlength=len(bounds))
    assert counts.min() > 0.3 * counts.mean()      # quantile buckets hold similar numbers of records
    assert bucket_bounds(np.array([], dtype=int), 100) == []


def test_cut_bounds_records_and_tokens() -> None:
    tokens = np.array([10] * 25 + [300] * 5)
    runs = cut(np.arange(30), tokens, max_records=10, max_tokens=700)
    assert np.concatenate(runs).tolist() == list(range(30))
    assert all(len(r) <= 10 and (tokens[r].sum() <= 700 or len(r) == 1) for r in runs)
