"""S3 conventions against the real moto S3 server: the standard region chain, the SHA-256 batchinf
computes sent as the object checksum (S3 verifies it on receipt; moto stores it), SSE-KMS and extra put arguments
accepted and stored, and S3 Inventory manifest.json (CSV and Parquet) as `input.manifest`."""

from __future__ import annotations

import base64
import csv
import gzip
import hashlib
import io
import json
import os
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf import config
from batchinf.errors import ManifestError
from batchinf.manifest import parse_manifest
from batchinf.store import get_store
from batchinf.store import s3 as s3store
from batchinf.planning.pin import Bounds, list_inputs
from batchinf.scopes import Storage

pytestmark = pytest.mark.integration


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, s3_server: str):  # noqa: ANN201
    config.settings.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    config.settings.cache_clear()


def _raw() -> object:
    return boto3.client("s3", endpoint_url=os.environ["BATCHINF_S3_ENDPOINT_URL"])


def test_region_chain(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION", "BATCHINF_S3_REGION", "AWS_PROFILE"):
        env.delenv(name, raising=False)
    env.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    config.settings.cache_clear()
    assert s3store.client().meta.region_name == "us-east-1"            # nothing configured

    cfg = tmp_path / "aws-config"
    cfg.write_text("[profile ops]\nregion = eu-west-3\n")
    env.setenv("AWS_CONFIG_FILE", str(cfg))
    env.setenv("AWS_PROFILE", "ops")
    config.settings.cache_clear()
    assert s3store.client().meta.region_name == "eu-west-3"            # the profile's region

    env.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    config.settings.cache_clear()
    assert s3store.client().meta.region_name == "ap-south-1"

    env.setenv("AWS_REGION", "ca-central-1")                          # the SDKs' standard variable wins
    config.settings.cache_clear()
    assert s3store.client().meta.region_name == "ca-central-1"

    env.setenv("BATCHINF_S3_REGION", "sa-east-1")
    config.settings.cache_clear()
    assert s3store.client().meta.region_name == "sa-east-1"


def test_uploads_carry_sha256_checksum_and_operator_options(env: pytest.MonkeyPatch, s3_bucket: str,
                                                            tmp_path: Path) -> None:
    env.setenv("BATCHINF_S3_SSE_KMS_KEY_ID", "arn:aws:kms:us-east-1:123456789012:key/test-key")
    env.setenv("BATCHINF_S3_PUT_EXTRA", json.dumps({"StorageClass": "STANDARD_IA"}))
    config.settings.cache_clear()
    store = get_store(s3_bucket)
    data = b"hello checksum\n" * 1000
    path = tmp_path / "part.parquet"
    path.write_bytes(data[::-1])
    bucket = s3_bucket.removeprefix("s3://")
    store.put_bytes(f"{s3_bucket}/a.bin", data)
    store.put_file(f"{s3_bucket}/b.bin", path)
    for key, body in (("a.bin", data), ("b.bin", data[::-1])):
        head = _raw().head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        assert head["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(body).digest()).decode()
        assert head["ServerSideEncryption"] == "aws:kms"
        assert head["SSEKMSKeyId"].endswith("key/test-key")
        assert head["StorageClass"] == "STANDARD_IA"

    attrs = _raw().get_object_attributes(Bucket=bucket, Key="a.bin", ObjectAttributes=["Checksum"])
    assert attrs["Checksum"]["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(data).digest()).decode()

    env.setenv("BATCHINF_S3_SSE", "nonsense")
    config.settings.cache_clear()
    with pytest.raises(Exception, match="BATCHINF_S3_SSE"):
        config.settings()


def _objects(s3_bucket: str, n: int) -> list[str]:
    keys = [f"data/part {i}+x.jsonl" for i in range(n)]   # space and '+': CSV inventories URL-encode keys
    for i, k in enumerate(keys):
        get_store(s3_bucket).put_bytes(f"{s3_bucket}/{k}", json.dumps({"id": f"r{i}", "text": "t"}).encode() + b"\n")
    return keys


def _inventory(s3_bucket: str, fmt: str, rows: list[dict]) -> str:
    """Write an S3 Inventory (data file + manifest.json) as S3 does; returns the manifest's uri."""
    bucket = s3_bucket.removeprefix("s3://")
    if fmt == "CSV":
        buf = io.StringIO()
        w = csv.writer(buf, quoting=csv.QUOTE_ALL)
        for r in rows:
            w.writerow([r["bucket"], r["key"].replace("%", "%25").replace("+", "%2B").replace(" ", "+"),
                        r["version_id"] or "", str(r["is_latest"]).lower(), str(r["is_delete_marker"]).lower(),
                        str(r["size"])])
        blob, key = gzip.compress(buf.getvalue().encode()), "inv/data/a.csv.gz"
        schema = "Bucket, Key, VersionId, IsLatest, IsDeleteMarker, Size"
    else:
        out = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), out)
        blob, key = out.getvalue(), "inv/data/a.parquet"
        schema = "message s3.inventory { required binary bucket (UTF8); required binary key (UTF8); ... }"
    get_store(s3_bucket).put_bytes(f"{s3_bucket}/{key}", blob)
    manifest = {"sourceBucket": bucket, "destinationBucket": f"arn:aws:s3:::{bucket}", "version": "2016-11-30",
                "fileFormat": fmt, "fileSchema": schema,
                "files": [{"key": key, "size": len(blob), "MD5checksum": hashlib.md5(blob).hexdigest()}]}
    get_store(s3_bucket).put_bytes(f"{s3_bucket}/inv/manifest.json", json.dumps(manifest).encode())
    return f"{s3_bucket}/inv/manifest.json"


@pytest.mark.parametrize("fmt", ["CSV", "Parquet"])
def test_s3_inventory_manifest_as_input(s3_bucket: str, fmt: str) -> None:
    keys = _objects(s3_bucket, 20)
    bucket = s3_bucket.removeprefix("s3://")
    pins = {p.uri: p for p in get_store(s3_bucket).list(f"{s3_bucket}/data/")}
    rows = [{"bucket": bucket, "key": k, "version_id": pins[f"{s3_bucket}/{k}"].version_id, "is_latest": True,
             "is_delete_marker": False, "size": pins[f"{s3_bucket}/{k}"].size} for k in keys]
    rows.append({"bucket": bucket, "key": "data/gone.jsonl", "version_id": "x", "is_latest": True,
                 "is_delete_marker": True, "size": 0})                      # skipped: a delete marker
    rows.append({"bucket": bucket, "key": keys[0], "version_id": "old", "is_latest": False,
                 "is_delete_marker": False, "size": 1})                     # skipped: not the latest
    uri = _inventory(s3_bucket, fmt.upper(), rows)
    m = parse_manifest({"name": "inv", "task": "embed", "bundle": "tiny@prod",
                        "input": {"manifest": uri, "format": "jsonl"}, "output": {"uri": f"{s3_bucket}/out/"}})
    got = list_inputs(m.input, Storage("default", confined=False), Bounds("default"))
    assert [p.uri for p in got] == [f"{s3_bucket}/{k}" for k in keys]       # in the inventory's order
    assert [(p.etag, p.version_id) for p in got] == [(pins[p.uri].etag, pins[p.uri].version_id) for p in got]


def test_inventory_of_another_format_is_refused(s3_bucket: str) -> None:
    get_store(s3_bucket).put_bytes(f"{s3_bucket}/inv/manifest.json", json.dumps(
        {"destinationBucket": "arn:aws:s3:::x", "fileFormat": "ORC", "fileSchema": "", "files": []}).encode())
    m = parse_manifest({"name": "inv", "task": "embed", "bundle": "tiny@prod",
                        "input": {"manifest": f"{s3_bucket}/inv/manifest.json", "format": "jsonl"},
                        "output": {"uri": f"{s3_bucket}/out/"}})
    with pytest.raises(ManifestError, match="ORC: batchinf reads CSV and Parquet"):
        list_inputs(m.input, Storage("default", confined=False), Bounds("default"))
