"""Small objects planned in groups (planning/context.py `object_groups`, planning/stage.py
`stage_group`): the same shards, byte for byte, as each object planned alone, in one process or
in a pool; a group with an object that cannot be read is staged object by object, so the error
is that object's alone."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchinf.errors import InputError
from batchinf.ledger import jobs
from batchinf.manifest import parse_manifest
from batchinf.planning import context, pin_job
from batchinf.planning.context import group_uri, object_groups
from batchinf.store import ObjectPin
from batchinf.submit import submit
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.env import OPERATOR
from tests.helpers.stages import plan_job
from tests.helpers.stages import planned_shards as _planned


def _pins(*sizes: int, gz: int | None = None) -> list[SimpleNamespace]:
    return [SimpleNamespace(pin=ObjectPin(f"file:///in/o{k}.jsonl" + (".gz" if k == gz else ""), n, "e"), idx=k)
            for k, n in enumerate(sizes)]


def test_groups_are_runs_of_small_whole_objects_up_to_the_budget() -> None:
    def idxs(items: list[SimpleNamespace], budget: int = 100) -> list[list[int]]:
        return [[t.idx for t in g] for g in object_groups(items, "jsonl", True, budget)]

    assert idxs(_pins(40, 40, 40, 10, 90, 5, 5, 1)) == [[0, 1], [2, 3], [4, 5, 6]]   # 40+40+40 > 100; 90+5+5+1 too
    assert idxs(_pins(10, 200, 10, 10, 10)) == [[2, 3, 4]]                        # a big object breaks the run
    assert idxs(_pins(10, 10, 10, gz=1)) == []                                    # compressed: never grouped
    assert idxs(_pins(10, 10), budget=0) == []


def _corpus(root: Path, n: int = 6) -> None:
    for k in range(n):
        write_jsonl(root / f"o{k}.jsonl", 12 + 3 * k, seed=k, bad=k % 2 == 0, prefix=f"x{k % 3}-")   # ids repeat


def _plan(tmp_path: Path, name: str, processes: int = 1) -> str:
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in") + "/", str(tmp_path / name),
                                               shards={"max_records": 20, "max_tokens": 600})), OPERATOR)
    plan_job(job_id, processes=processes)
    return job_id


@pytest.mark.parametrize("processes", [1, 2])
def test_a_grouped_job_has_the_shards_of_its_objects_planned_alone(tmp_path: Path, tiny_bundle: str,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   processes: int) -> None:
    _corpus(tmp_path / "in")
    grouped = _plan(tmp_path, "grouped", processes)
    monkeypatch.setattr(context, "GROUP_BYTES", 0)
    alone = _plan(tmp_path, "alone")
    work = Path(jobs.get(grouped).work_uri.removeprefix("file://"))
    assert sorted(p.name for p in (work / "plan").glob("*.parquet")) == ["grp-00000-00005.parquet"]
    assert sorted(p.name for p in (Path(jobs.get(alone).work_uri.removeprefix("file://")) / "plan").glob("*")) == \
        [f"obj-{k:05d}.parquet" for k in range(6)]
    got, want = _planned(grouped), _planned(alone)
    assert got == want and want[1]["invalid_by_code"]["duplicate_id"] > 0
    assert [o.attempts for o in jobs.inputs(grouped)] == [1] * 6


def test_a_group_with_an_unreadable_object_is_staged_object_by_object(tmp_path: Path, tiny_bundle: str) -> None:
    """The group fails on object 2 (changed since it was pinned); its objects are staged alone:
    those before it are planned, it has its own error, and once it is fixed the job plans the
    rest, with the shards of a job that never failed."""
    from batchinf.dispatch import plan_objects_here

    _corpus(tmp_path / "in", n=4)
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in") + "/", str(tmp_path / "out"),
                                               shards={"max_records": 20, "max_tokens": 600})), OPERATOR)
    pin_job(jobs.get(job_id))
    bad = tmp_path / "in" / "o2.jsonl"
    original = bad.read_bytes()
    bad.write_bytes(original + json.dumps({"id": "late", "text": "added after the pin"}).encode() + b"\n")
    with pytest.raises(InputError):
        plan_objects_here(jobs.get(job_id), list(range(4)), processes=1)
    objs = jobs.inputs(job_id)
    assert [o.records is not None for o in objs] == [True, True, False, False]
    assert "o2.jsonl" in (objs[2].error or "") and objs[3].error is None
    job = jobs.get(job_id)
    work = Path(job.work_uri.removeprefix("file://")) / "plan"
    assert not Path(group_uri(job.work_uri, 0, 3).removeprefix("file://")).exists()
    assert sorted(p.name for p in work.glob("*.parquet")) == ["obj-00000.parquet", "obj-00001.parquet"]
    bad.write_bytes(original)
    plan_job(job_id)
    assert jobs.get(job_id).status == "running"
    fresh = _plan(tmp_path, "fresh")
    assert _planned(job_id) == _planned(fresh)
