"""`batchinf run` as a real process: kill -9 mid-job, then resume; inputs and outputs on S3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pyarrow.parquet as pq
import pytest
import yaml
from sqlalchemy import func, select

from batchinf.controller import drive
from batchinf.ledger.jobs import get as job_row
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.ledger.db import tx
from batchinf.ledger.tables import job_events, shards
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from batchinf.store import get_store
from batchinf.verify import verify_output
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.services import make_bucket

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _committed(job_id: str) -> dict[str, int]:
    with tx() as conn:
        rows = conn.execute(select(shards.c.id, shards.c.attempt)
                            .where(shards.c.job_id == job_id, shards.c.status == "committed")).all()
    return dict(rows)


def test_run_resumes_after_kill_9(tmp_path: Path, tiny_bundle: str, bi_home: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", 1500, seed=5)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(str(tmp_path / "a.jsonl"), str(tmp_path / "out"),
                                            shards={"max_records": 100})))
    env = dict(os.environ, BATCHINF_FAILPOINTS="execute.after_commit=sleep(0.3)")
    cmd = [sys.executable, "-m", "batchinf.cli", "run", str(path), "--json"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    job_id = None
    while time.monotonic() < deadline:
        with tx() as conn:
            job_id = conn.execute(select(shards.c.job_id).limit(1)).scalar()
        if job_id and len(_committed(job_id)) >= 3:
            break
        time.sleep(0.1)
    assert job_id, "the run never planned"
    os.kill(proc.pid, signal.SIGKILL)            # the driver dies at once; its workers follow
    proc.wait()
    before = _committed(job_id)
    total = len(job_row(job_id).id and _all_shards(job_id))
    assert 3 <= len(before) < total, "kill came too late to test resuming"

    again = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    s = json.loads(again.stdout)
    assert s["job_id"] == job_id and s["status"] == "succeeded"
    after = _committed(job_id)
    assert all(after[sid] == attempt for sid, attempt in before.items()), "a committed shard was redone"
    with tx() as conn:
        n_commits = conn.execute(select(func.count()).select_from(job_events).where(
            job_events.c.job_id == job_id, job_events.c.to_status == "committed")).scalar()
    assert n_commits == total
    assert verify_output(s["output_uri"])["ok"]
    results = pq.read_table(tmp_path / "out", ignore_prefixes=["_", "errors"])
    assert results.num_rows == 1500 and len(set(results.column("record_id").to_pylist())) == 1500


def _all_shards(job_id: str) -> list[str]:
    with tx() as conn:
        return conn.execute(select(shards.c.id).where(shards.c.job_id == job_id)).scalars().all()


def test_s3_inputs_pinned_by_version(tmp_path: Path, tiny_bundle: str, s3_bucket: str) -> None:
    """Input prefix and output on a versioned S3 server; an object overwritten after the job
    pinned it is still read at the pinned version."""
    s3 = boto3.client("s3", endpoint_url=os.environ["BATCHINF_S3_ENDPOINT_URL"])
    bucket = s3_bucket.removeprefix("s3://")
    good_a = write_jsonl(tmp_path / "a.jsonl", 120, seed=7)
    good_b = write_jsonl(tmp_path / "b.jsonl", 80, seed=8, bad=False, prefix="b")
    s3.upload_file(str(tmp_path / "a.jsonl"), bucket, "in/a.jsonl")
    s3.upload_file(str(tmp_path / "b.jsonl"), bucket, "in/b.jsonl")
    job_id, _ = submit(parse_manifest(manifest(f"{s3_bucket}/in/", f"{s3_bucket}/out/")), OPERATOR)

    from batchinf.ledger.jobs import get as get_job
    from batchinf.planning import pin_job
    pin_job(get_job(job_id))                                  # pins versions; planning reads later
    s3.put_object(Bucket=bucket, Key="in/b.jsonl", Body=b'{"id": "new", "text": "replaced"}\n')
    assert drive(job_id, workers=1, threads=1) == "succeeded"

    report = verify_output(f"{s3_bucket}/out/")
    assert report["counts"]["records_succeeded"] == len(good_a) + len(good_b)
    manifest_json = json.loads(get_store(s3_bucket).get_bytes(f"{s3_bucket}/out/_MANIFEST.json"))
    assert all(i["version_id"] for i in manifest_json["inputs"])
    ids = set()
    for p in manifest_json["parts"]:
        if p["kind"] == "results":
            ids |= set(read_table(f"{s3_bucket}/out/{p['key']}").column("record_id").to_pylist())
    assert ids == set(good_a) | set(good_b)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="out/")["Contents"]]
    assert "out/_SUCCESS" in keys and not any("_work" in k for k in keys)
    # the scratch is gone with its versions: no non-current staging copies, no delete markers
    versions = s3.list_object_versions(Bucket=bucket)
    left = [v["Key"] for v in versions.get("Versions", []) + versions.get("DeleteMarkers", [])
            if "_work" in v["Key"] or "/attempts/" in v["Key"] or "/shards/" in v["Key"]]
    assert not left, left[:5]


def test_input_manifest_and_changed_object(tmp_path: Path, tiny_bundle: str, s3_server: str) -> None:
    """An input manifest lists objects (S3 Inventory style); on an unversioned bucket, an object
    changed after pinning fails the job with a message naming it."""
    bucket_uri = make_bucket(versioned=False)
    bucket = bucket_uri.removeprefix("s3://")
    s3 = boto3.client("s3", endpoint_url=os.environ["BATCHINF_S3_ENDPOINT_URL"])
    write_jsonl(tmp_path / "a.jsonl", 30, bad=False)
    s3.upload_file(str(tmp_path / "a.jsonl"), bucket, "data/a.jsonl")
    s3.put_object(Bucket=bucket, Key="data/ignored.jsonl", Body=b'{"id": "x", "text": "not listed"}\n')
    s3.put_object(Bucket=bucket, Key="inputs.jsonl",
                  Body=json.dumps({"Bucket": bucket, "Key": "data/a.jsonl"}).encode() + b"\n")
    m = manifest("", str(tmp_path / "out"))
    m["input"] = {"manifest": f"{bucket_uri}/inputs.jsonl", "format": "jsonl"}
    job_id, _ = submit(parse_manifest(m), OPERATOR)
    from batchinf.ledger.jobs import get as get_job
    from batchinf.planning import pin_job
    pin_job(get_job(job_id))
    s3.put_object(Bucket=bucket, Key="data/a.jsonl", Body=b'{"id": "z", "text": "changed"}\n')
    assert drive(job_id, workers=1, threads=1) == "failed"
    err = job_row(job_id).error
    assert "data/a.jsonl" in err and "changed" in err and "re-submit" in err
