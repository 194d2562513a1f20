"""A large input object is planned in parts (planning/ranges.py): JSONL by byte ranges aligned to line
starts, Parquet by runs of row groups, compressed objects whole. Whatever the parts, the staged
shards, their ledger rows and the plan are exactly those of planning every object whole:
ordinals, line numbers in messages and duplicate ids count in the whole object."""

from __future__ import annotations

import gzip
import io
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.config import settings
from batchinf.formats.jsonl import json_objects, part_objects
from batchinf.ledger import jobs, shards
from batchinf.manifest import parse_manifest
from batchinf.planning.context import Planning, part_tasks
from batchinf.planning.ranges import Range, object_parts, renumber
from batchinf.store import ObjectPin
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from tests.helpers.corpus import awkward_jsonl as _awkward
from tests.helpers.corpus import manifest, texts
from tests.helpers.corpus import record_line as _record
from tests.helpers.stages import plan_job
from tests.helpers.stages import planned_shards as _planned

WHOLE = str(1 << 40)


def _cut_everywhere(data: bytes, size: int) -> list[tuple[int, str, Any]]:
    """json_objects of `data` read as parts of `size` bytes, renumbered as the global step does."""
    got, records, lines = [], 0, 0
    for start in range(0, len(data), size):
        tally: dict[str, int] = {}
        for ordinal, where, obj in part_objects(io.BytesIO(data), "u", start, min(len(data), start + size), tally):
            n = int(where.rsplit(" ", 1)[1])
            got.append((ordinal + records, f"u line {n + lines}", obj if isinstance(obj, dict) else
                        (obj.error, obj.message.replace(where, f"u line {n + lines}", 1))))
        records, lines = records + tally["records"], lines + tally["lines"]
    return got


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 333, 4096])
def test_parts_read_every_line_once_numbered_as_in_the_whole_object(size: int) -> None:
    data = (b"\n\n" + _awkward(3, 40, "r") + b"\n{not json\r\n\n" + _record("last", "no final newline"))
    want = [(o, w, obj if isinstance(obj, dict) else (obj.error, obj.message))
            for o, w, obj in json_objects(io.BytesIO(data), "u")]
    assert _cut_everywhere(data, size) == want
    assert want[-1][2] == {"id": "last", "text": "no final newline"}


def test_a_line_longer_than_the_limit_is_skipped_across_parts() -> None:
    data = _record("a", "x") + b"\n" + b"y" * 5000 + b"\n" + _record("b", "z")
    for size in (10, 100, 3000):
        got, records = [], 0
        for start in range(0, len(data), size):
            tally: dict[str, int] = {}
            got += [(o + records, getattr(obj, "error", None))
                    for o, _, obj in part_objects(io.BytesIO(data), "u", start, min(len(data), start + size),
                                                  tally, max_line_bytes=1000)]
            records += tally["records"]
        assert got == [(0, None), (1, "line_too_long"), (2, None)]


def test_one_place_decides_the_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINF_PLAN_RANGE_BYTES", "100")
    settings.cache_clear()
    pin = ObjectPin("file:///in/a.jsonl", 250, "e")
    assert object_parts(pin, "jsonl") == [Range(0, 0, 83), Range(1, 83, 166), Range(2, 166, 250)]
    assert len(object_parts(ObjectPin("file:///in/a.parquet", 1000, "e"), "parquet") or []) == 10
    assert object_parts(ObjectPin("file:///in/a.jsonl", 100, "e"), "jsonl") is None          # not above it
    for name in ("a.jsonl.gz", "a.JSONL.ZST", "a.jsonl.bz2"):                                  # compressed: whole
        assert object_parts(ObjectPin(f"file:///in/{name}", 10_000, "e"), "jsonl") is None
    assert object_parts(ObjectPin("file:///in/a.jsonl", 10_000, "e"), "openai-batch") is None
    assert object_parts(pin, "jsonl", splittable=False) is None                                # a retry job


def test_renumber_shifts_ordinals_and_the_readers_line_and_row_numbers() -> None:
    t = pa.table({"ordinal": pa.array([0, 3], pa.int64()),
                  "message": ["s3://b/k line 2: malformed JSON", None]})
    out = renumber(t, "s3://b/k", 10, 25)
    assert out.column("ordinal").to_pylist() == [10, 13]
    assert out.column("message").to_pylist() == ["s3://b/k line 27: malformed JSON", None]
    t = pa.table({"ordinal": pa.array([1], pa.int64()), "message": ["s3://b/k row 1: record 'x' has no text"]})
    assert renumber(t, "s3://b/k", 7, 7).column("message").to_pylist() == ["s3://b/k row 8: record 'x' has no text"]


# --- whole planning and planning in parts give the same shards -----------------------------------


def _corpus(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "a.jsonl").write_bytes(_awkward(1, 120, "a") + b"\n")
    b = _awkward(2, 150, "b").split(b"\n")
    b.insert(len(b) // 2, _record("b3", "a duplicate of b3, in a later part"))
    b.insert(len(b) * 3 // 4, b"{not json")
    (root / "b.jsonl").write_bytes(b"\n".join(b))
    with gzip.open(root / "c.jsonl.gz", "wb") as f:                       # compressed: planned whole
        f.write(_awkward(4, 80, "c") + b"\n")
    (root / "d.jsonl").write_bytes(gzip.compress(_awkward(5, 60, "d")))   # gzip by its magic bytes
    (root / "e.jsonl").write_bytes(_awkward(6, 90, "e") + b"\n" + _record("a7", "a duplicate in the last part")
                                   + b"\n" + _record("e5", "and one within the object"))


def _plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, range_bytes: str,
          processes: int = 1, **extra: Any) -> str:
    monkeypatch.setenv("BATCHINF_PLAN_RANGE_BYTES", range_bytes)
    settings.cache_clear()
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in") + "/", str(tmp_path / name),
                                               shards={"max_records": 25, "max_tokens": 700}, **extra)), OPERATOR)
    plan_job(job_id, processes=processes)
    return job_id


def _error_rows(job_id: str) -> list[dict]:
    return [r for s in shards.of_job(job_id) if s.bucket < 0
            for r in pq.read_table(s.input_uri.removeprefix("file://")).to_pylist()]


def test_planning_in_parts_stages_the_very_shards_of_whole_planning(tmp_path: Path, tiny_bundle: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _corpus(tmp_path / "in")
    whole = _plan(tmp_path, monkeypatch, "whole", WHOLE)
    split = _plan(tmp_path, monkeypatch, "split", "700")
    tasks = Planning(jobs.get(split)).object_tasks()
    counts = {Path(t.pin.uri).name: len(part_tasks(t)) for t in tasks}
    assert counts["c.jsonl.gz"] == 1 and counts["a.jsonl"] > 10 and counts["b.jsonl"] > 10
    assert counts["d.jsonl"] > 1 and counts["e.jsonl"] > 5
    assert _planned(split) == _planned(whole)

    rows = _error_rows(split)
    dups = {(Path(r["source"]).name, r["record_id"]): r["message"] for r in rows if r["error"] == "duplicate_id"}
    assert set(dups) == {("b.jsonl", "b3"), ("e.jsonl", "a7"), ("e.jsonl", "e5")}
    assert "a.jsonl record 7" in dups[("e.jsonl", "a7")] and "b.jsonl record 3;" in dups[("b.jsonl", "b3")]
    lines = (tmp_path / "in" / "b.jsonl").read_bytes().split(b"\n")
    bad = next(r for r in rows if r["error"] == "malformed_json" and r["source"].endswith("b.jsonl"))
    assert f"b.jsonl line {lines.index(b'{not json') + 1}:" in bad["message"]
    nonblank = [x for x in lines if x.strip()]
    assert bad["ordinal"] == nonblank.index(b"{not json")


@pytest.mark.slow
def test_parts_plan_in_a_process_pool(tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(_awkward(7, 60, "a") + b"\n{not json")
    whole = _plan(tmp_path, monkeypatch, "whole", WHOLE)
    split = _plan(tmp_path, monkeypatch, "split", "1500", processes=2)
    assert len(part_tasks(Planning(jobs.get(split)).object_tasks()[0])) > 2
    assert _planned(split) == _planned(whole)
    assert [o.attempts for o in jobs.inputs(split)] == [1]


def test_parquet_is_planned_by_row_groups(tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "in").mkdir()
    rows = [{"id": f"p{i}", "text": t} for i, t in enumerate(texts(300, 9))]
    rows[250]["id"] = "p10"                     # a duplicate in a later row group
    rows[120]["text"] = ""                      # an error row: its row number in the whole object
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in" / "a.parquet", row_group_size=40)
    input_ = {"uri": str(tmp_path / "in") + "/", "format": "parquet"}
    whole = _plan(tmp_path, monkeypatch, "whole", WHOLE, input=input_)
    split = _plan(tmp_path, monkeypatch, "split", "2000", input=input_)
    assert len(part_tasks(Planning(jobs.get(split)).object_tasks()[0])) > 3
    assert _planned(split) == _planned(whole)
    errors = {r["record_id"]: r for r in _error_rows(split)}
    assert errors["p120"]["ordinal"] == 120 and "a.parquet row 120:" in errors["p120"]["message"]
    assert errors["p10"]["ordinal"] == 250 and "a.parquet record 10;" in errors["p10"]["message"]


def test_a_dry_run_reports_the_same_counts(tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.dryrun import plan_only, report

    _corpus(tmp_path / "in")
    reports = []
    for name, size in (("whole", WHOLE), ("split", "900")):
        monkeypatch.setenv("BATCHINF_PLAN_RANGE_BYTES", size)
        settings.cache_clear()
        job_id = plan_only(parse_manifest(manifest(str(tmp_path / "in") + "/", str(tmp_path / name))), OPERATOR)
        r = report(job_id)
        reports.append({k: v for k, v in r.items() if k not in ("job_id", "next", "plan_seconds", "estimate")})
    assert reports[0] == reports[1] and reports[0]["records"] > 400


def test_a_broker_sends_the_parts_and_the_last_one_staged_records_the_object(
        tmp_path: Path, tiny_bundle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.planning import finish_plan, pin_job, plan_one_object, plan_sent_part

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(_awkward(8, 80, "a") + b"\n{not json\n")
    whole = _plan(tmp_path, monkeypatch, "whole", WHOLE)
    monkeypatch.setenv("BATCHINF_PLAN_RANGE_BYTES", "1200")
    settings.cache_clear()
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in") + "/", str(tmp_path / "split"),
                                               shards={"max_records": 25, "max_tokens": 700})), OPERATOR)
    pin_job(jobs.get(job_id))
    sent: list[int] = []
    assert plan_one_object(job_id, 0, send_parts=sent.extend) == 0
    assert len(sent) > 3 and sent == list(range(len(sent)))
    sent_at = jobs.inputs(job_id)[0].started_at or 0.0
    for k in reversed(sent[1:]):                      # every part but the first, in any order
        plan_sent_part(job_id, 0, k)
    assert (jobs.inputs(job_id)[0].started_at or 0.0) > sent_at     # each part keeps the attempt alive
    assert jobs.inputs(job_id)[0].records is None     # not all staged: the object is not planned
    again: list[int] = []                             # the lifecycle sends the object again
    plan_one_object(job_id, 0, send_parts=again.extend)
    assert again == [0]                               # only the part not staged
    plan_sent_part(job_id, 0, 0)
    obj = jobs.inputs(job_id)[0]
    assert (obj.records, obj.attempts, obj.error) == (jobs.inputs(whole)[0].records, 2, None)
    finish_plan(jobs.get(job_id))
    assert _planned(job_id) == _planned(whole)


def test_a_global_step_that_cuts_other_parts_is_refused(tmp_path: Path, tiny_bundle: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.planning.bucketing import StagedMismatch
    from batchinf.dispatch import plan_objects_here
    from batchinf.planning import finish_plan, pin_job

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(_awkward(9, 40, "a"))
    for staged, step in (("700", WHOLE), (WHOLE, "700")):
        monkeypatch.setenv("BATCHINF_PLAN_RANGE_BYTES", staged)
        settings.cache_clear()
        job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in") + "/", str(tmp_path / f"out-{staged}"))), OPERATOR)
        pin_job(jobs.get(job_id))
        plan_objects_here(jobs.get(job_id), [0], processes=1)
        monkeypatch.setenv("BATCHINF_PLAN_RANGE_BYTES", step)
        settings.cache_clear()
        with pytest.raises(StagedMismatch, match="a.jsonl was staged in other parts.*BATCHINF_PLAN_RANGE_BYTES"):
            finish_plan(jobs.get(job_id))
