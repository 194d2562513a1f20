"""Dataset prefixes written by Spark, Hive or Arrow, and batchinf's own published output used as
the next job's input: a prefix listing skips the files kept beside the data (`_SUCCESS`,
`_common_metadata`, `.part-*.crc`, `_work/`), so `batchinf run` reads exactly the data records;
`input.include_hidden: true` reads them all again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.planning.pin import hidden
from tests.helpers.corpus import manifest


def test_hidden_are_names_starting_with_underscore_or_dot_below_the_prefix() -> None:
    p = "s3://b/ds/"
    names = ["part-0.parquet", "_SUCCESS", "_common_metadata", ".part-0.parquet.crc", "year=2024/part-1.parquet",
             "_temporary/0/part-2.parquet", "sub/.hidden/x.parquet", "errors/part-0.parquet", "a_b.parquet"]
    assert [n for n in names if not hidden(p, p + n)] == [
        "part-0.parquet", "year=2024/part-1.parquet", "errors/part-0.parquet", "a_b.parquet"]
    # an object named on its own is read even if its name starts with _
    assert not hidden("s3://b/ds/_one.jsonl", "s3://b/ds/_one.jsonl")


def _run(path: Path, m: dict) -> subprocess.CompletedProcess:
    path.write_text(json.dumps(m))
    return subprocess.run([sys.executable, "-m", "batchinf.cli", "run", str(path), "--json", "--threads", "1"],
                          env=dict(os.environ), capture_output=True, text=True, timeout=300)


def _result_ids(out: Path) -> list[str]:
    return sorted(pq.read_table(out, ignore_prefixes=["_", "errors", "."]).column("record_id").to_pylist())


def _errors(out: Path) -> list[dict]:
    return pq.read_table(out / "errors").to_pylist() if (out / "errors").exists() else []


@pytest.mark.integration
def test_a_spark_style_parquet_prefix_runs_with_every_data_record(tmp_path: Path, tiny_bundle: str) -> None:
    ds = tmp_path / "spark"
    ds.mkdir()
    ids = []
    for k in range(2):
        rows = {"id": [f"s{k}-{i}" for i in range(12)], "text": [f"spark row {k} {i}" for i in range(12)]}
        ids += rows["id"]
        pq.write_table(pa.table(rows), ds / f"part-{k:05d}-c000.snappy.parquet")
        (ds / f".part-{k:05d}-c000.snappy.parquet.crc").write_bytes(b"crc\x00\x01\x02\x03")
    (ds / "_SUCCESS").write_bytes(b"")
    pq.write_metadata(pa.schema([("id", pa.string()), ("text", pa.string())]), ds / "_common_metadata")
    (ds / "_temporary" / "0").mkdir(parents=True)
    (ds / "_temporary" / "0" / "part-00009.parquet").write_bytes(b"PAR1 half-written")
    out = tmp_path / "out"
    m = manifest(str(ds) + "/", str(out))
    m["input"]["format"] = "parquet"
    r = _run(tmp_path / "job.json", m)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["status"] == "succeeded"
    assert _result_ids(out) == sorted(ids) and _errors(out) == []

    # opting back in reads the hidden files too: each is one object-level error row
    out2 = tmp_path / "out2"
    m = manifest(str(ds) + "/", str(out2), name="hidden-too")
    m["input"].update(format="parquet", include_hidden=True)
    r = _run(tmp_path / "job2.json", m)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _result_ids(out2) == sorted(ids)
    bad = {(e["source"].rsplit("/", 1)[-1], e["error"]) for e in _errors(out2)}
    assert bad == {("_SUCCESS", "corrupt_object"), (".part-00000-c000.snappy.parquet.crc", "wrong_format"),
                   (".part-00001-c000.snappy.parquet.crc", "wrong_format"),
                   ("part-00009.parquet", "corrupt_object")}, bad


@pytest.mark.integration
def test_a_published_batchinf_output_is_the_next_jobs_input(tmp_path: Path, tiny_bundle: str) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "a.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "text": f"first job record {i}"}) + "\n"
                                         for i in range(20)))
    first = tmp_path / "first"
    r = _run(tmp_path / "a.json", manifest(str(inp) + "/", str(first), shards={"max_records": 8}))
    assert r.returncode == 0, r.stdout + r.stderr
    assert (first / "_SUCCESS").exists() and (first / "_MANIFEST.json").exists()

    # the second job embeds the first one's `source` column, keyed by its record_id
    second = tmp_path / "second"
    m = manifest(str(first) + "/", str(second), name="second")
    m["input"].update(format="parquet", id_field="record_id", text_field="source")
    r = _run(tmp_path / "b.json", m)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _result_ids(second) == sorted(f"r{i}" for i in range(20))
    assert _errors(second) == []
