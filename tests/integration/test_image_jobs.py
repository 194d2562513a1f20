"""Task classify_image end to end on the embedded default: images as Parquet bytes and as object
URIs, bad images (corrupt, a decompression bomb over the pixel limit, an unreachable URI, one
outside the tenant's grants, a missing field) as error rows naming the record, exactly-once
coverage, labels and scores equal to the runtime's own, the label counts in _MANIFEST.json, the
status object and the REST API, and a rerun byte-identical."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf import scopes
from batchinf.bundles import import_bundle, open_runtime
from batchinf.controller import drive
from batchinf.ledger.states import JobStatus
from batchinf.ledger.status import status
from batchinf.manifest import parse_manifest
from batchinf.runtime.classifier import activate
from batchinf.runtime.images import decode
from batchinf.submit import submit
from batchinf.scopes import Caller
from batchinf.verify import MANIFEST, verify_output
from tests.helpers.api_service import rest_status
from tests.helpers.tiny_vit import LABELS, bomb_png, corrupt_png, image_bytes, make_tiny_vit

pytestmark = pytest.mark.integration


def _job(tmp_path: Path, name: str, tenant: str = "default") -> tuple[Path, str]:
    out = tmp_path / "out" / name
    m = {"name": name, "task": "classify_image", "bundle": "vit@prod", "output": {"uri": str(out)},
         "input": {"uri": str(tmp_path / "in") + "/", "format": "parquet", "image_field": "img"},
         "shards": {"max_records": 16}, "options": {"max_pixels": 1_000_000, "max_batch_images": 5, "top_k": 2}}
    job_id, _ = submit(parse_manifest(m), Caller(tenant, operator=True))
    assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
    return out, job_id


def _read(out: Path) -> tuple[list[dict], list[dict]]:
    res = pq.read_table(out, ignore_prefixes=["_", "errors"]).to_pylist()
    errs = pq.read_table(out / "errors").to_pylist() if (out / "errors").exists() else []
    return res, errs


def test_classify_image_job(tmp_path: Path, bi_home: Path) -> None:
    digest = import_bundle(make_tiny_vit(tmp_path / "vit", crop=True), "vit", alias="prod").digest
    images = {f"b{i}": image_bytes(i, (20 + 5 * i, 60 - i), "JPEG" if i % 3 else "PNG") for i in range(30)}
    objects = tmp_path / "objects"
    objects.mkdir()
    for i in range(8):
        (objects / f"u{i}.png").write_bytes(image_bytes(100 + i, (50, 40)))
    rows = [{"id": k, "img": v} for k, v in images.items()]
    uri_rows = [{"id": f"u{i}", "img": f"file://{objects}/u{i}.png"} for i in range(8)]
    bad = [{"id": "corrupt", "img": corrupt_png()}, {"id": "bomb", "img": bomb_png(2000, 2000)},
           {"id": "gone", "img": f"file://{objects}/nope.png"}, {"id": "noimg", "img": None}]
    (tmp_path / "in").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:12] + bad[:2] + rows[12:]), tmp_path / "in" / "a.parquet")
    pq.write_table(pa.table({"id": [r["id"] for r in uri_rows + bad[2:]],
                             "img": pa.array([r["img"] for r in uri_rows + bad[2:]], pa.string())}),
                   tmp_path / "in" / "b.parquet")

    out, job_id = _job(tmp_path, "first")
    res, errs = _read(out)
    assert sorted((e["record_id"], e["error"]) for e in errs) == [
        ("bomb", "image_too_large"), ("corrupt", "bad_image"), ("gone", "image_unreachable"),
        ("noimg", "missing_image")]
    bomb = next(e for e in errs if e["record_id"] == "bomb")["message"]
    assert "4000000 pixels" in bomb and "options.max_pixels" in bomb
    keys = [(r["source"], r["ordinal"]) for r in res + errs]
    assert len(keys) == len(set(keys)) == 42                     # exactly once, every record

    rt = open_runtime(digest)
    data = {**images, **{f"u{i}": (objects / f"u{i}.png").read_bytes() for i in range(8)}}
    res.sort(key=lambda r: r["record_id"])
    px = np.stack([rt.preprocessor.to_pixels(decode(data[r["record_id"]], 10**6)) for r in res])
    probs = activate(rt.logits(px), "softmax")
    assert [r["label"] for r in res] == [LABELS[i] for i in probs.argmax(1)]
    np.testing.assert_allclose([r["score"] for r in res], probs.max(1), atol=1e-6)
    assert all(len(r["top"]) == 2 and r["top"][0]["label"] == r["label"] for r in res)
    assert next(r for r in res if r["record_id"] == "b3")["image_width"] == 35

    man = json.loads((out / MANIFEST).read_text())
    assert man["task"] == "classify_image" and sum(man["counts"]["labels"].values()) == 38
    assert verify_output(str(out))["ok"]
    st = status(job_id)
    assert st["task"] == "classify_image" and st["counts"]["records_failed"] == 4
    assert st["summary"] == {"labels": man["counts"]["labels"]} == rest_status(job_id)["summary"]

    out2, _ = _job(tmp_path, "again")       # the same input again: byte-identical parts
    shas = [{p["key"]: p["sha256"] for p in json.loads((o / MANIFEST).read_text())["parts"]} for o in (out, out2)]
    assert shas[0] == shas[1]


def test_image_uris_are_confined_to_the_tenants_grants(tmp_path: Path, bi_home: Path) -> None:
    import_bundle(make_tiny_vit(tmp_path / "vit"), "vit", alias="prod")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "s.png").write_bytes(image_bytes(7))
    for d in ("in", "imgs"):
        (tmp_path / d).mkdir()
    (tmp_path / "imgs" / "ok.png").write_bytes(image_bytes(8))
    pq.write_table(pa.table({"id": ["inside", "outside"],
                             "img": [f"file://{tmp_path}/imgs/ok.png", f"file://{secret}/s.png"]}),
                   tmp_path / "in" / "a.parquet")
    scopes.grant("acme", read=[str(tmp_path / "in"), str(tmp_path / "imgs")], write=[str(tmp_path / "out")])
    out, _ = _job(tmp_path, "confined", tenant="acme")
    res, errs = _read(out)
    assert [r["record_id"] for r in res] == ["inside"]
    assert [(e["record_id"], e["error"]) for e in errs] == [("outside", "image_forbidden")]
    assert "tenant 'acme'" in errs[0]["message"]
