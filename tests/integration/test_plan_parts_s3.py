"""Large objects planned in parts on a versioned S3 bucket (moto): parts read the pinned version
by ranged GETs even after the object is overwritten, and the job's outputs and _MANIFEST.json
are those of the same job planned whole."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Any

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.config import settings
from tests.helpers.env import OPERATOR
from batchinf.controller import drive
from batchinf.ledger import jobs
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from batchinf.planning import pin_job
from batchinf.planning.context import Planning, part_tasks
from batchinf.store import get_store
from tests.helpers.corpus import awkward_jsonl as _awkward
from tests.helpers.corpus import manifest, texts
from tests.helpers.corpus import record_line as _record

pytestmark = pytest.mark.integration


def _upload(s3: Any, bucket: str, tmp_path: Path) -> list[bytes]:
    a = _awkward(1, 90, "a").split(b"\n")
    a.insert(len(a) * 2 // 3, b"{not json")
    a.append(_record("a4", "a duplicate of a4 in the last part"))
    s3.put_object(Bucket=bucket, Key="in/a.jsonl", Body=b"\n".join(a) + b"\n")
    rows = [{"id": f"p{i}", "text": t} for i, t in enumerate(texts(200, 4))]
    rows[150]["id"] = "p10"                                   # a duplicate in a later row group
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet", row_group_size=30)
    s3.upload_file(str(tmp_path / "b.parquet"), bucket, "in/b.parquet")
    s3.put_object(Bucket=bucket, Key="in/c.jsonl.gz", Body=gzip.compress(_awkward(2, 40, "c") + b"\n"))
    return a


def _run(s3_bucket: str, name: str, range_bytes: str, monkeypatch: pytest.MonkeyPatch,
         overwrite: Any = None, fmt: str = "jsonl") -> dict[str, Any]:
    monkeypatch.setenv("BATCHINF_PLAN_RANGE_BYTES", range_bytes)
    settings.cache_clear()
    from batchinf.submit import submit

    out = f"{s3_bucket}/{name}/"
    ids = []
    for f, pattern in ((fmt, "a.jsonl"), ("parquet", "b.parquet"), ("jsonl", "c.jsonl.gz")):
        job_id, _ = submit(parse_manifest(manifest(f"{s3_bucket}/in/{pattern}", f"{out}{pattern}/",
                                                   input={"uri": f"{s3_bucket}/in/{pattern}", "format": f},
                                                   shards={"max_records": 30})), OPERATOR)
        pin_job(jobs.get(job_id))
        ids.append(job_id)
    if overwrite:
        overwrite()
    parts = [len(part_tasks(t)) for job_id in ids for t in Planning(jobs.get(job_id)).object_tasks()]
    for job_id in ids:
        assert drive(job_id, workers=1, threads=1) == "succeeded"
    store = get_store(s3_bucket)
    got: dict[str, Any] = {"parts": parts}
    for job_id, pattern in zip(ids, ("a.jsonl", "b.parquet", "c.jsonl.gz")):
        m = json.loads(store.get_bytes(f"{out}{pattern}/_MANIFEST.json"))
        rows = [r for p in m["parts"] for r in read_table(f"{out}{pattern}/{p['key']}").to_pylist()]
        got[pattern] = {"rows": rows, "manifest": _normalized(m, job_id, out)}
    return got


def _normalized(m: dict[str, Any], job_id: str, out: str) -> str:
    """_MANIFEST.json without what differs between two jobs of the same inputs: their ids and
    shard ids (hashes of the job id), output prefix, timings and phases. The parts' sha256 stay."""
    text = json.dumps(m, sort_keys=True).replace(job_id, "JOB").replace(out, "OUT/")
    drop = {"created_at", "timings", "phases", "shard"}

    def clean(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k not in drop}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(json.loads(text)), sort_keys=True)


def test_parts_read_the_pinned_version_and_give_the_outputs_of_whole_planning(
        tmp_path: Path, tiny_bundle: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    s3 = boto3.client("s3", endpoint_url=os.environ["BATCHINF_S3_ENDPOINT_URL"])
    bucket = s3_bucket.removeprefix("s3://")
    lines = _upload(s3, bucket, tmp_path)
    whole = _run(s3_bucket, "whole", str(1 << 40), monkeypatch)

    def overwrite() -> None:          # after pinning: the parts must read the pinned versions
        s3.put_object(Bucket=bucket, Key="in/a.jsonl", Body=b'{"id": "new", "text": "replaced"}\n')
        s3.put_object(Bucket=bucket, Key="in/b.parquet", Body=b"not parquet any more")

    split = _run(s3_bucket, "split", "1500", monkeypatch, overwrite)
    assert whole["parts"] == [1, 1, 1] and split["parts"][0] > 5 and split["parts"][1] > 3 and split["parts"][2] == 1
    for pattern in ("a.jsonl", "b.parquet", "c.jsonl.gz"):
        assert split[pattern]["manifest"] == whole[pattern]["manifest"], pattern
        assert split[pattern]["rows"] == whole[pattern]["rows"], pattern
    errors = {r["record_id"]: r for r in split["a.jsonl"]["rows"] if r.get("error")}
    assert "a.jsonl record 4;" in errors["a4"]["message"]
    assert "b.parquet record 10;" in next(r for r in split["b.parquet"]["rows"] if r.get("ordinal") == 150)["message"]
    bad = next(r for r in split["a.jsonl"]["rows"] if r.get("error") == "malformed_json")
    assert bad["ordinal"] == [x for x in lines if x.strip()].index(b"{not json")
    assert f"a.jsonl line {lines.index(b'{not json') + 1}:" in bad["message"]
