"""A job over hostile objects (a 300 MiB JSONL line, a decompression bomb, a gzip object beside
plain ones) completes: each hostile thing is one error row naming it, every other record has its
result exactly once."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchinf.controller import drive
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.manifest import parse_manifest
from batchinf.verify import verify_output
from tests.helpers.corpus import bomb, manifest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _lines(prefix: str, n: int) -> bytes:
    return "".join(json.dumps({"id": f"{prefix}{i}", "text": f"{prefix} record {i}"}) + "\n"
                   for i in range(n)).encode()


def test_hostile_objects_become_error_rows_and_the_job_succeeds(tmp_path: Path, tiny_bundle: str) -> None:
    inp = tmp_path / "in"
    inp.mkdir()
    with open(inp / "a.jsonl", "wb") as f:
        f.write(_lines("a", 20))
        f.write(b'{"id": "huge", "text": "' + b"z" * (300 << 20) + b'"}\n')
        f.write(_lines("a2-", 20))
    (inp / "b.jsonl.gz").write_bytes(gzip.compress(_lines("b", 30)))
    (inp / "c.jsonl.gz").write_bytes(bomb(3, 300))          # records r0..r2, then 300 MiB of spaces
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(inp) + "/", str(out), shards={"max_records": 16})), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == "succeeded"
    assert verify_output(str(out))["ok"]
    ids = pq.read_table(out, ignore_prefixes=["_", "errors"]).column("record_id").to_pylist()
    expected = ([f"a{i}" for i in range(20)] + [f"a2-{i}" for i in range(20)] + [f"b{i}" for i in range(30)]
                + ["r0", "r1", "r2"])
    assert sorted(ids) == sorted(expected)
    errors = {(e["source"].rsplit("/", 1)[-1], e["error"]) for e in pq.read_table(out / "errors").to_pylist()}
    assert errors == {("a.jsonl", "line_too_long"), ("c.jsonl.gz", "object_too_large")}
