"""Shard sizing by work: enough shards for the pool, none below the minimum work, equal work per
shard within a bucket, within the manifest's caps -- over a bucket's groups of equal-length
records as the global planning step cuts them (`cut_groups_balanced`), and over one shard's
records as a split cuts them (`cut_balanced`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinf.planning.bucketing import cut_all, cut_groups, extra_work
from batchinf.ledger import jobs, shards
from batchinf.ledger.states import JobStatus
from batchinf.lifecycle import step
from batchinf.manifest import parse_manifest
from batchinf.config import settings as config
from batchinf.planning.sizing import SHARDS_PER_WORKER, cut_balanced, cut_groups_balanced, min_shard_work, target_work
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.stages import InProcess


def _lengths(n: int, seed: int = 0) -> np.ndarray:
    """Heavy-tailed token counts like the benchmark corpus (median ~40, capped at 256)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(40), 1.0, n).astype(np.int64), 3, 256)


def _groups(tokens: np.ndarray, objects: int = 1) -> list[tuple[int, int, int]]:
    """(object, length, count) of these records (record i in object i % objects), by length then object."""
    obj = np.arange(len(tokens)) % objects
    keys, counts = np.unique(np.stack([tokens, obj], axis=1), axis=0, return_counts=True)
    return [(int(o), int(L), int(c)) for (L, o), c in zip(keys, counts)]


def _shards(tokens: np.ndarray, workers: int | None, max_records: int = 4096,
            max_tokens: int = 1_000_000) -> list[list[tuple[int, int, int]]]:
    """The global step's cut: by work for a worker count of 2 or more, else by the caps alone."""
    groups = _groups(tokens, objects=3)
    target = target_work(int(tokens.sum()), workers, max_tokens)
    if not workers or workers <= 1:
        return cut_groups(groups, max_records, max_tokens)
    return cut_groups_balanced(groups, [L * c for _, L, c in groups], target, max_records, max_tokens)


def _records(run: list[tuple[int, int, int]]) -> int:
    return sum(c for _, _, c in run)


def _work(run: list[tuple[int, int, int]], extra: dict[tuple[int, int], float] | None = None) -> float:
    return sum(c * (L + (extra or {}).get((o, L), 0)) for o, L, c in run)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 600), min_size=1, max_size=300), st.integers(1, 5000), st.integers(1, 60),
       st.integers(1, 40_000))
def test_runs_cover_every_record_once_in_order_within_caps(tokens: list[int], target: int, max_records: int,
                                                           max_tokens: int) -> None:
    """A split's cut of one shard's records."""
    work = np.array(tokens, dtype=np.int64)
    order = np.arange(len(tokens))[::-1].copy()
    runs = cut_balanced(order, work, target, max_records, max_tokens, min_work=1)
    assert np.concatenate(runs).tolist() == order.tolist()
    assert all(len(r) and len(r) <= max_records for r in runs)
    assert all(len(r) == 1 or work[r].sum() <= max_tokens for r in runs)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 600), st.integers(1, 50), st.integers(0, 300)), min_size=1, max_size=40),
       st.integers(1, 5000), st.integers(1, 60), st.integers(1, 40_000))
def test_group_runs_cover_every_record_once_in_order_within_caps(spec: list[tuple[int, int, int]], target: int,
                                                                 max_records: int, max_tokens: int) -> None:
    """The global step's cut of a bucket's groups (length, count, the group's max_tokens per
    record: generate work): every record once, in order, each run within the caps by work."""
    groups = [(i % 3, L, c) for i, (L, c, _) in enumerate(spec)]
    per = {(i % 3, L): m for i, (L, _, m) in enumerate(spec)}     # later duplicates of a key: theirs
    work = [c * (L + per[(o, L)]) for o, L, c in groups]
    runs = cut_groups_balanced(groups, work, target, max_records, max_tokens, min_work=1)
    flat = [(o, L) for run in runs for o, L, c in run for _ in range(c)]
    assert flat == [(o, L) for o, L, c in groups for _ in range(c)]
    assert all(run and all(c > 0 for _, _, c in run) and _records(run) <= max_records for run in runs)
    assert all(_records(run) == 1 or _work(run, per) <= max_tokens for run in runs)


def test_group_cut_equals_the_record_cut() -> None:
    """Over groups it cuts exactly where cut_balanced cuts the same records, by work too."""
    tokens = np.sort(_lengths(3000))
    groups = _groups(tokens)
    decode = {L: L % 7 for _, L, _ in groups}             # generate: each record's max_tokens
    work = tokens + np.array([decode[int(t)] for t in tokens])
    for target in (5000, 20_000, 100_000):
        by_records = cut_balanced(np.arange(len(tokens)), work, target, 500, 200_000, min_work=1)
        by_groups = cut_groups_balanced(groups, [c * (L + decode[L]) for _, L, c in groups], target, 500,
                                        200_000, min_work=1)
        assert [len(r) for r in by_records] == [_records(r) for r in by_groups]


def test_shard_counts_for_small_jobs_across_pool_sizes() -> None:
    job_3k, job_1k, tiny = _lengths(3000), _lengths(1000, seed=1), _lengths(100, seed=2)
    MIN_SHARD_WORK = min_shard_work()
    assert MIN_SHARD_WORK == 10_000                                      # the measured default
    assert job_3k.sum() > 8 * SHARDS_PER_WORKER * MIN_SHARD_WORK / 2     # big enough for 4 workers' shards
    counts = {w: len(_shards(job_3k, w)) for w in (None, 1, 2, 4)}
    # one worker (or an unknown fleet): the caps alone, one shard; else SHARDS_PER_WORKER per worker
    assert counts == {None: 1, 1: 1, 2: 2 * SHARDS_PER_WORKER, 4: 4 * SHARDS_PER_WORKER}
    # more workers than the job has minimum-work shards for: bounded by MIN_SHARD_WORK
    assert len(_shards(job_3k, 64)) == job_3k.sum() // MIN_SHARD_WORK
    # fewer minimum-work shards than SHARDS_PER_WORKER each: a multiple of the workers (5 -> 4)
    fits = job_1k.sum() // MIN_SHARD_WORK
    assert fits == 5 and len(_shards(job_1k, 2)) == fits - fits % 2
    assert all(len(_shards(tiny, w)) == 1 for w in (1, 2, 8, 64))          # a tiny job stays one shard
    # the manifest's caps still bound every shard
    capped = _shards(job_3k, 2, max_records=100)
    assert len(capped) >= 30 and all(_records(r) <= 100 for r in capped)


def test_work_per_shard_is_balanced_not_records() -> None:
    tokens = _lengths(3000)
    for workers in (2, 4, 8):
        runs = _shards(tokens, workers)
        work = [_work(r) for r in runs]
        records = [_records(r) for r in runs]
        assert max(work) - min(work) <= 2 * tokens.max(), (workers, work)   # equal up to a record or two
        assert max(records) > 2 * min(records)        # short records' shards hold more of them
        assert all(w >= min_shard_work() for w in work)


def test_target_work_bounds() -> None:
    assert target_work(10**6, 2, 1_000_000) == 10**6 // (2 * SHARDS_PER_WORKER)
    assert target_work(1000, 8, 1_000_000) == min_shard_work()         # never below the minimum
    assert target_work(10**9, 2, 50_000) == 50_000                     # never above max_tokens
    assert target_work(10**6, None, 400_000) == target_work(10**6, 1, 400_000) == 400_000
    # too small for SHARDS_PER_WORKER each: a multiple of the workers, each at least the minimum
    assert target_work(191, 2, 10**6, min_work=60) == 96                  # 2 shards, not 3
    assert target_work(300, 2, 10**6, min_work=60) == 75                  # 4, not 5
    assert target_work(100, 2, 10**6, min_work=60) == 60                  # one shard's worth: as before
    assert target_work(7 * 60, 3, 10**6, min_work=60) == 70               # 6 of 7 minutes' worth


RECORDS = 120


class Pool(InProcess):
    """An in-process dispatcher that says how many workers will run the job."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def workers(self, route: object = None) -> int | None:
        return self.n


def _planned_by_step(tmp_path: Path, name: str, d: InProcess, **shards_spec: object) -> str:
    write_jsonl(tmp_path / name / "in.jsonl", RECORDS, seed=3, bad=False)
    raw = manifest(str(tmp_path / name / "in.jsonl"), str(tmp_path / name / "out"),
                   shards={"max_records": 4096, **shards_spec})
    job_id, _ = submit(parse_manifest(dict(raw, name=name)), OPERATOR)
    while jobs.get(job_id).status != JobStatus.RUNNING:
        assert step(job_id, d, slots=0)
    return job_id


def test_the_lifecycle_cuts_a_job_for_the_dispatchers_workers(tmp_path: Path, tiny_bundle: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINF_MIN_SHARD_TOKENS", "1")     # the tiny corpus has few tokens
    config.cache_clear()
    counts, pools = {}, {n: Pool(n) for n in (1, 3)}
    for n, d in pools.items():
        job_id = _planned_by_step(tmp_path, f"w{n}", d)
        planned = [s for s in shards.of_job(job_id) if s.bucket >= 0]
        counts[n] = len(planned)
        assert jobs.get(job_id).plan["workers"] == n
        assert sum(s.num_records for s in planned) == RECORDS
    assert counts == {1: 1, 3: 3 * SHARDS_PER_WORKER}
    # the manifest's hint wins over the dispatcher's count; an unknown fleet is cut by the caps
    hinted = _planned_by_step(tmp_path, "hint", InProcess(), target_workers=2)
    assert len([s for s in shards.of_job(hinted) if s.bucket >= 0]) == 2 * SHARDS_PER_WORKER
    # the finely cut job still runs to success, every record once
    while jobs.get(job_id).status != JobStatus.SUCCEEDED:
        assert step(job_id, pools[3])
    ids = pq.read_table(tmp_path / "w3" / "out", columns=["record_id"], ignore_prefixes=["_", "errors"])
    assert sorted(ids.column("record_id").to_pylist()) == sorted(f"r{i}" for i in range(RECORDS))


def test_generate_work_counts_the_max_tokens_the_summaries_sum() -> None:
    """A generate object's summary sums its records' max_tokens per length; the global step adds
    them to the groups' work (scaled down where duplicates left the group), so 4 records of 5
    prompt tokens decoding 10 each are two shards of work 30 at a target of 22, not one of 20."""
    summaries = [{"valid": [[5, 4]], "valid_extra": [[5, 40]]}, {"valid": [[5, 4]]}]
    assert extra_work(summaries, [{5: 3}, {5: 4}]) == [{5: 30}, {}]
    extra = extra_work(summaries, [{5: 4}, {}])
    with_decode = cut_all([5], [{5: 4}], [{}], 100, 10**6, target=22, extra=extra)
    assert [_records(s.slices) for s in with_decode] == [2, 2]
    assert [_records(s.slices) for s in cut_all([5], [{5: 4}], [{}], 100, 10**6, target=22)] == [4]


def test_a_generate_job_of_two_full_batches_is_two_shards_on_two_workers() -> None:
    """A generate shard is one continuous batch: the floor is a full batch of max_slots records
    (or an equal share of the workers), so 128 prompts of 41 tokens + 64 to decode on two workers
    are two shards of 64 that run side by side (the general floor of 10,000 made them one)."""
    from batchinf.tasks.generate import Generate, GenerateOptions

    g, opts = Generate(), GenerateOptions(max_tokens=64, max_slots=64)
    lengths = np.full(128, 41)
    work = int(lengths.sum()) + 128 * 64
    floor = g.shard_floor(opts, 128, work, 2)
    assert floor == 64 * work // 128
    groups = [(0, 41, 128)]
    runs = cut_groups_balanced(groups, [work], target_work(work, 2, 10**9, floor), 4096, 10**9, floor)
    assert [_records(r) for r in runs] == [64, 64]
    # smaller than a batch a worker: an equal share each; far larger: SHARDS_PER_WORKER a worker
    assert target_work(40 * 105, 2, 10**9, g.shard_floor(opts, 40, 40 * 105, 2)) == 20 * 105
    big = target_work(4000 * 105, 2, 10**9, g.shard_floor(opts, 4000, 4000 * 105, 2))
    assert -(-4000 * 105 // big) == 2 * SHARDS_PER_WORKER
    assert g.shard_floor(opts, 0, 0, 2) is None


def test_a_few_long_audio_files_are_one_shard_a_worker_of_full_batches() -> None:
    """A transcribe shard's windows run in batches of max_batch_windows, and a small batch decodes
    each window slower: the floor is a full batch of windows (or an equal share of the workers),
    so three 2.6-minute files staged as six pieces of about 80 s are two shards of three pieces on
    two workers (the task's one-minute floor made them six), while a long job is still cut
    SHARDS_PER_WORKER a worker and the floor never drops under the minute."""
    from batchinf.tasks.transcribe import Transcribe
    from batchinf.tasks.transcribe_options import TranscribeOptions

    t, opts = Transcribe(), TranscribeOptions(max_batch_windows=16)
    groups, work = [(0, 77, 3), (0, 78, 1), (0, 81, 2)], [231, 78, 162]
    total = sum(work)
    floor = t.shard_floor(opts, 6, total, 2)
    assert floor == total // 2
    runs = cut_groups_balanced(groups, work, target_work(total, 2, 10**9, floor), 4096, 10**9, floor)
    assert [_records(r) for r in runs] == [3, 3]
    six = cut_groups_balanced(groups, work, target_work(total, 2, 10**9, 60), 4096, 10**9, 60)
    assert len(six) == 6
    assert t.shard_floor(opts, 2000, 3600 * 100, 2) == 16 * 30          # a full batch of windows
    hours = target_work(3600 * 100, 2, 10**9, t.shard_floor(opts, 2000, 3600 * 100, 2))
    assert -(-3600 * 100 // hours) == 2 * SHARDS_PER_WORKER
    assert t.shard_floor(TranscribeOptions(max_batch_windows=1), 10, 100, 8) == t.min_shard_work
