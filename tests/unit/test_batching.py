"""Token-budget batching and global length bucketing (plan/execute hot paths)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinf.tasks.batching import token_budget_batches
from tests.helpers.reference_plan import bucket_bounds, cut


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


def test_generate_isolating_keeps_finished_answers_and_isolates_the_failing_record() -> None:
    """A generation call that raises midway: answers already finished are kept, the unfinished
    requests are retried in halves until only the failing record fails."""
    from types import SimpleNamespace

    from batchinf.tasks.batching import GenOutcome, generate_isolating

    calls: list[list[int]] = []

    def generate(reqs: list) -> object:
        calls.append([r.key for r in reqs])
        for r in reqs:
            if r.key == 5:
                raise RuntimeError("NaN logits")
            yield SimpleNamespace(key=r.key)

    out = GenOutcome()
    generate_isolating(generate, [SimpleNamespace(key=k) for k in range(10)], [f"r{k}" for k in range(10)], out)
    assert sorted(out.results) == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert out.failures == {5: "RuntimeError: NaN logits"}
    assert calls[0] == list(range(10)) and all(5 not in c or len(c) <= 5 for c in calls[1:])
    assert sum(len(c) for c in calls) < 25      # halving, not one call per record
