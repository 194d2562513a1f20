"""The global planning step works from the planning tasks' summaries (bucketing.py): its shard
files are byte for byte those of the whole-job reference step (tests/helpers/reference_plan.py),
duplicate ids are found across objects and id ranges without one dict, and its peak memory does
not grow with the job."""

from __future__ import annotations

import hashlib
import json
import random
import tracemalloc
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pytest

from batchinf.planning import bucketing
from batchinf.ledger import jobs, retry_records, shards
from batchinf.manifest import parse_manifest
from batchinf.parts import STAGE_ROW_GROUP, read_table, write_table
from batchinf.planning import finish_plan
from batchinf.planning import context, summary
from batchinf.planning.context import Planning
from batchinf.planning.finish import grouped_objects
from batchinf.planning.summary import read_summary, without_summary
from batchinf.planning.stage import stage_part
from batchinf.tasks import base
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from tests.helpers.corpus import manifest, record_line, texts, write_jsonl
from tests.helpers.reference_plan import bucket_bounds, cut, reference_shards
from tests.helpers.stages import plan_job


def test_histogram_bounds_and_group_cuts_equal_the_record_level_ones() -> None:
    rng = np.random.default_rng(7)
    for n in (1, 2, 5, 37, 400, 2500):
        lengths = rng.integers(0, 60, size=n) * rng.integers(1, 3, size=n)
        hist = dict(zip(*np.unique(lengths, return_counts=True)))
        for max_records in (1, 7, 100, 5000):
            assert bucketing.bounds_from_histogram({int(k): int(v) for k, v in hist.items()}, max_records) \
                == bucket_bounds(lengths, max_records)
        objs = rng.integers(0, 3, size=n)
        order = np.lexsort((objs, lengths))
        groups, i = [], 0
        while i < n:        # runs of equal (length, object) in (length, object) order
            j = i
            while j < n and lengths[order[j]] == lengths[order[i]] and objs[order[j]] == objs[order[i]]:
                j += 1
            groups.append((int(objs[order[i]]), int(lengths[order[i]]), j - i))
            i = j
        for max_records, max_tokens in ((5, 40), (100, 10**9), (3, 1), (1000, 75)):
            want = [len(r) for r in cut(order, lengths, max_records, max_tokens)]
            got = [sum(k for _, _, k in s) for s in bucketing.cut_groups(groups, max_records, max_tokens)]
            assert got == want


def _corpus(root: Path, n: int = 150) -> None:
    write_jsonl(root / "a.jsonl", n, seed=1)                             # bad lines: r0 duplicated in a
    write_jsonl(root / "b.jsonl", n, seed=2, bad=False, prefix="b")
    write_jsonl(root / "c.jsonl", n // 2, seed=3, bad=False, prefix="r")  # r0..: duplicates of a's ids
    with open(root / "d.jsonl", "a") as f:                               # the last record of the last object
        f.write(json.dumps({"id": "b0", "text": "one more"}) + "\n" + json.dumps({"id": "b7", "text": "x y"}) + "\n")


def _sha(uri_or_path: str) -> str:
    return hashlib.sha256(Path(uri_or_path.removeprefix("file://")).read_bytes()).hexdigest()


def _staged(job: jobs.Job, tasks: list) -> list[tuple[pa.Table, dict]]:
    """Each object's staged rows and summary, from its group's file or its own."""
    grouped = grouped_objects(tasks, job.work_uri)
    out = []
    for o, t in enumerate(tasks):
        if o in grouped:
            uri, s = grouped[o]
            out.append((without_summary(read_table(uri)).slice(s["offset"], s["rows"]), s))
        else:
            out.append((without_summary(read_table(t.stage_uri)), read_summary(t.stage_uri)))
    return out


def _assert_same_as_reference(tmp_path: Path, job_id: str) -> list[dict]:
    job = jobs.get(job_id)
    tasks = Planning(job).object_tasks()
    uris = [t.pin.uri for t in tasks]
    want, plan = reference_shards(job_id, uris, [t for t, _ in _staged(job, tasks)],
                                  job.manifest.shards.max_records,
                                  job.manifest.shards.max_tokens, retry_records.selection(job_id))
    got = sorted(shards.of_job(job_id), key=lambda s: (s.bucket, s.ordinal))
    assert [(s.bucket, s.ordinal, s.id, s.num_records, s.num_tokens) for s in got] == \
        [(w["bucket"], w["ordinal"], w["id"], w["num_records"], w["num_tokens"]) for w in want]
    for s, w in zip(got, want):
        ref = str(tmp_path / "ref.parquet")
        write_table(ref, w["table"], row_group_size=STAGE_ROW_GROUP)
        assert _sha(s.input_uri) == _sha(ref), f"shard {s.bucket}/{s.ordinal} differs from the reference"
    assert {k: job.plan[k] for k in plan} == plan
    return want


# The four small objects staged as one group, their ids in their summaries (up to ID_SAMPLES:
# two of the four) or, 1 held there, in ids files; or each object staged alone.
STAGING = pytest.mark.parametrize("id_samples,group_bytes", [(summary.ID_SAMPLES, context.GROUP_BYTES),
                                                             (1, context.GROUP_BYTES), (summary.ID_SAMPLES, 0)],
                                  ids=["grouped", "grouped-ids-files", "objects-alone"])


@STAGING
def test_shard_files_are_byte_identical_to_the_whole_job_step(tmp_path: Path, tiny_bundle: str, id_samples: int,
                                                              group_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bucketing, "DEDUP_RANGE_RECORDS", 40)    # several id ranges
    monkeypatch.setattr(summary, "ID_SAMPLES", id_samples)
    monkeypatch.setattr(context, "GROUP_BYTES", group_bytes)
    _corpus(tmp_path / "in")
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in") + "/", str(tmp_path / "out"),
                                               shards={"max_records": 40, "max_tokens": 900})), OPERATOR)
    plan_job(job_id)
    job = jobs.get(job_id)
    tasks = Planning(job).object_tasks()
    assert sorted(grouped_objects(tasks, job.work_uri)) == ([0, 1, 2, 3] if group_bytes else [])
    assert [Path(t.stage_uri.removeprefix("file://")).exists() for t in tasks] == [not group_bytes] * 4
    summaries = [s for _, s in _staged(job, tasks)]
    held = [s["ids"] <= id_samples for s in summaries]
    assert [Path(summary.ids_uri(t.stage_uri).removeprefix("file://")).exists() for t in tasks] == \
        [not h for h in held]
    assert any(held) == (id_samples != 1) and not all(held)
    # several id ranges (one sample per object splits the ids more coarsely)
    assert len(bucketing.id_splits(summaries, 40)) >= (3 if id_samples > 1 else 2)
    want = _assert_same_as_reference(tmp_path, job_id)
    dups = [r for w in want for r in w["table"].to_pylist() if r["error"] == "duplicate_id"]
    uris = {Path(u.removeprefix("file://")).name for u in [r["source"] for r in dups]}
    assert uris == {"a.jsonl", "c.jsonl", "d.jsonl"}
    assert len(dups) == 1 + 75 + 2                # r0 in a; all of c; both of d (b0, b7 of b)
    last = next(r for r in dups if r["source"].endswith("d.jsonl") and r["record_id"] == "b7")
    assert "b.jsonl record 7" in last["message"]
    assert jobs.get(job_id).plan["invalid_by_code"]["duplicate_id"] == 78


def test_a_retry_selection_plans_only_its_records_as_before(tmp_path: Path, tiny_bundle: str) -> None:
    _corpus(tmp_path / "in", n=60)
    raw = manifest(str(tmp_path / "in") + "/", str(tmp_path / "out"), shards={"max_records": 10})
    a, c = ((tmp_path / "in" / f).resolve().as_uri() for f in ("a.jsonl", "c.jsonl"))
    pick = [(a, o) for o in range(0, 66, 3)] + [(c, o) for o in range(0, 30, 4)]
    job_id, _ = submit(parse_manifest(raw), OPERATOR, selection=pick)
    plan_job(job_id)
    _assert_same_as_reference(tmp_path, job_id)
    assert jobs.get(job_id).records_total == len(pick)


@STAGING
def test_staged_files_lost_in_a_crash_are_planned_again(tmp_path: Path, tiny_bundle: str, id_samples: int,
                                                        group_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged files are written without fsync: after a machine crash one may be missing or short.
    The global step then plans those objects again (and only those; a group's file: all its
    objects) instead of cutting shards from them, and the shards are those of a plan without the crash."""
    from batchinf.dispatch import plan_objects_here
    from batchinf.planning import pin_job
    from batchinf.planning.summary import ids_uri

    monkeypatch.setattr(summary, "ID_SAMPLES", id_samples)
    monkeypatch.setattr(context, "GROUP_BYTES", group_bytes)
    _corpus(tmp_path / "in", n=60)
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in") + "/", str(tmp_path / "out"),
                                               shards={"max_records": 10})), OPERATOR)
    pin_job(jobs.get(job_id))
    plan_objects_here(jobs.get(job_id), list(range(4)), processes=1)
    job = jobs.get(job_id)
    tasks = Planning(job).object_tasks()
    if group_bytes:
        group = context.group_uri(job.work_uri, 0, 3)
        # the group's file never reached the disk, or half of an ids file beside it did
        torn = group if id_samples != 1 else ids_uri(tasks[3].stage_uri)
        lost = [True] * 4
    else:
        Path(tasks[1].stage_uri.removeprefix("file://")).unlink()                   # never reached the disk
        torn = tasks[3].stage_uri                                                   # half of it did: no footer
        lost = [False, True, False, True]
    with open(torn.removeprefix("file://"), "r+b") as f:
        f.truncate(10)
    finish_plan(jobs.get(job_id))
    assert jobs.get(job_id).status == "planning" and not shards.of_job(job_id)
    objs = jobs.inputs(job_id)
    assert [o.records is None for o in objs] == lost
    assert "staged files were lost" in (objs[1].error or "")
    plan_job(job_id)
    assert jobs.get(job_id).status == "running"
    _assert_same_as_reference(tmp_path, job_id)


def _planned_objects(tmp_path: Path, name: str, per_object: int, objects: int = 4, stage: bool = True) -> str:
    """A job of `objects` objects of `per_object` records each, pinned, its objects staged (unless
    not `stage`), the global step not run."""
    from batchinf.dispatch import plan_objects_here
    from batchinf.planning import pin_job

    rng = random.Random(5)
    root = tmp_path / name / "in"
    root.mkdir(parents=True)
    for k in range(objects):  # long texts: a staged object's token ids outweigh the step's fixed costs
        lines = [record_line(f"o{k}-{i}", t) for i, t in enumerate(texts(per_object, rng.randrange(1000), 40))]
        (root / f"o{k}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    job_id, _ = submit(parse_manifest(manifest(str(root) + "/", str(tmp_path / name / "out"),
                                               shards={"max_records": 500})), OPERATOR)
    pin_job(jobs.get(job_id))
    if stage:
        plan_objects_here(jobs.get(job_id), list(range(objects)), processes=1)
    return job_id


def _peak(fn: Callable[[], object]) -> int:
    """Peak bytes of Python objects (tracemalloc) plus Arrow buffers (which tracemalloc does not
    see: Arrow allocates from its own pool) while `fn` runs."""
    import pyarrow as pa

    default, pool = pa.default_memory_pool(), pa.proxy_memory_pool(pa.default_memory_pool())
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] + pool.max_memory()
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(default)


@pytest.mark.slow
def test_the_global_steps_peak_memory_does_not_grow_with_the_job(tmp_path: Path, tiny_bundle: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bucketing, "DEDUP_RANGE_RECORDS", 1000)
    finish_plan(jobs.get(_planned_objects(tmp_path, "warm-up", 100)))       # one-time imports and caches
    peaks, reference = [], []
    for name, n in (("small", 1000), ("large", 4000)):
        job = jobs.get(_planned_objects(tmp_path, name, n))
        tasks = Planning(job).object_tasks()
        staged = [t for t, _ in _staged(job, tasks)]
        reference.append(_peak(lambda: reference_shards(job.id, [t.pin.uri for t in tasks], staged, 500, 10**9)))
        peaks.append(_peak(lambda: finish_plan(job)))
    assert reference[1] > 2.5 * reference[0]          # the whole-job step grows with the job ...
    assert peaks[1] < 1.15 * peaks[0], f"global step peak {peaks[0]} B at 4,000 records, {peaks[1]} B at 16,000"


def _python_peak(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_a_planning_task_holds_one_chunk_of_records_as_python_objects(tmp_path: Path, tiny_bundle: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging turns rows into Arrow a chunk at a time: the Python objects a planning task holds
    (tracemalloc; Arrow's own buffers are the staged table) do not grow with its object."""
    monkeypatch.setattr(base, "STAGE_CHUNK", 500)
    peaks = []
    for name, n in (("small", 2000), ("large", 8000)):
        planning = Planning(jobs.get(_planned_objects(tmp_path, name, n, objects=1, stage=False)))
        task = planning.object_tasks()[0]
        peaks.append(_python_peak(lambda: stage_part(planning, task)))
    assert peaks[1] < 1.3 * peaks[0], f"planning task: {peaks[0]} B of Python objects at 2,000 records, " \
                                      f"{peaks[1]} B at 8,000"


def test_staged_binary_payloads_are_written_with_lz4_the_rest_with_zstd(tmp_path: Path) -> None:
    """Staged audio samples (and image bytes) are dense: a file with a binary column is lz4, which
    writes and reads 16-bit PCM an order of magnitude faster than zstd; other files stay zstd.
    Both read back the same rows."""
    import pyarrow.parquet as pq

    from batchinf.parts import write_scratch_table

    pcm = (np.sin(np.arange(160_000) / 7.0) * 12_000).astype("<i2").tobytes()
    audio = pa.table({"record_id": ["a", "b"], "samples": pa.array([pcm, pcm[:999]], pa.binary()),
                      "window_starts": [[0, 5], [0]]})
    text = pa.table({"record_id": ["a"], "text": ["hello"], "window_starts": [[0]]})
    for table, codec in ((audio, "LZ4"), (text, "ZSTD")):
        uri = str(tmp_path / f"{codec}.parquet")
        write_scratch_table(uri, table)
        meta = pq.ParquetFile(uri).metadata
        codecs = {meta.row_group(0).column(i).compression for i in range(meta.num_columns)}
        assert {c.split("_")[0] for c in codecs} == {codec}
        assert read_table(uri).equals(table)
