"""Tasks score, classify and classify_image in distributed mode, once: a controller and two Celery
workers as real processes over PostgreSQL, Redis and the S3 server run one job of each at once.
Every record is covered exactly once (a result or an error row), bad records are the expected
error rows (image URIs on S3 are pinned and read by the workers' planners, a missing one is an
error row), and the results equal what the runtime gives in this process."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.bundles import import_bundle, open_runtime
from batchinf.ledger.status import status
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from batchinf.runtime.classifier import activate
from batchinf.runtime.images import decode
from batchinf.store import get_store
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.verify import verify_output
from tests.helpers.cluster import Cluster, wait
from tests.helpers.tiny_classifiers import make_tiny_classifier
from tests.helpers.tiny_vit import bomb_png, corrupt_png, image_bytes, make_tiny_vit

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _put(bucket: str, key: str, data: bytes) -> str:
    uri = f"{bucket}/{key}"
    get_store(uri).put_bytes(uri, data)
    return uri


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _parquet(bucket: str, name: str, columns: dict) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf)
    _put(bucket, f"in-classify_image/{name}.parquet", buf.getvalue())


def _submit(bucket: str, task: str, fmt: str, inp: dict, options: dict) -> str:
    m = {"name": f"dist-{task}", "task": task, "bundle": f"{task}@prod", "output": {"uri": f"{bucket}/out-{task}/"},
         "input": {"uri": f"{bucket}/in-{task}/", "format": fmt, **inp}, "shards": {"max_records": 10},
         "options": options}
    return submit(parse_manifest(m), OPERATOR)[0]


def _outputs(bucket: str, task: str) -> tuple[list[dict], list[dict], dict]:
    out = f"{bucket}/out-{task}/"
    assert verify_output(out)["ok"]
    man = json.loads(get_store(out).get_bytes(out + "_MANIFEST.json"))
    rows: dict[str, list[dict]] = {"results": [], "errors": []}
    for p in man["parts"]:
        if p["kind"] in rows:
            rows[p["kind"]] += read_table(out + p["key"]).to_pylist()
    return rows["results"], rows["errors"], man


def _exactly_once(res: list[dict], errs: list[dict], n: int) -> None:
    keys = [(r["source"], r["ordinal"]) for r in res + errs]
    assert len(keys) == len(set(keys)) == n


def test_score_classify_and_images_on_a_cluster(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    import_bundle(make_tiny_classifier(tmp_path / "ce", num_labels=1, cross_encoder=True, seed=1), "score",
                  alias="prod")
    import_bundle(make_tiny_classifier(tmp_path / "cls", num_labels=3, seed=2), "classify", alias="prod")
    vit = import_bundle(make_tiny_vit(tmp_path / "vit", crop=True), "classify_image", alias="prod").digest
    rng = np.random.default_rng(5)
    words = "the of and to a in is it you that he was for on are with as his they be".split()
    text = lambda: " ".join(rng.choice(words, size=int(rng.integers(1, 20))))  # noqa: E731

    pairs = [{"id": f"p{i}", "query": text(), "document": text()} for i in range(40)]
    _put(s3_bucket, "in-score/a.jsonl", _jsonl(pairs + [{"id": "noq", "document": "d"}]))
    texts = [{"id": f"t{i}", "text": text()} for i in range(40)]
    _put(s3_bucket, "in-classify/a.jsonl", _jsonl(texts + [{"id": "empty", "text": " "}]))
    images = {f"b{i}": image_bytes(i, (30 + i, 44 - i)) for i in range(20)}
    uris = {f"u{i}": _put(s3_bucket, f"images/u{i}.png", image_bytes(50 + i, (41, 37))) for i in range(6)}
    _parquet(s3_bucket, "bytes", {"id": list(images), "img": list(images.values())})
    _parquet(s3_bucket, "uris", {"id": [*uris, "gone", "blank"],
                                 "img": [*uris.values(), f"{s3_bucket}/images/none.png", " "]})
    _parquet(s3_bucket, "bad", {"id": ["corrupt", "bomb"], "img": [corrupt_png(), bomb_png(2000, 2000)]})

    jobs = {"score": _submit(s3_bucket, "score", "jsonl", {}, {}),
            "classify": _submit(s3_bucket, "classify", "jsonl", {}, {"top_k": 2}),
            "classify_image": _submit(s3_bucket, "classify_image", "parquet", {"image_field": "img"},
                                      {"max_pixels": 1_000_000, "max_batch_images": 4})}
    cluster.controller()
    cluster.worker("w1")
    cluster.worker("w2")
    for job_id in jobs.values():
        assert wait(job_id, cluster, timeout=300)["status"] == "succeeded", cluster.log_tail()

    res, errs, man = _outputs(s3_bucket, "score")
    _exactly_once(res, errs, 41)
    assert [(e["record_id"], e["error"]) for e in errs] == [("noq", "missing_query")]
    assert status(jobs["score"])["summary"]["scores"] == 40

    res, errs, man = _outputs(s3_bucket, "classify")
    _exactly_once(res, errs, 41)
    assert [(e["record_id"], e["error"]) for e in errs] == [("empty", "empty_text")]
    assert sum(status(jobs["classify"])["summary"]["labels"].values()) == 40

    res, errs, man = _outputs(s3_bucket, "classify_image")
    _exactly_once(res, errs, 20 + 8 + 2)
    assert sorted((e["record_id"], e["error"]) for e in errs) == [
        ("blank", "invalid_image"), ("bomb", "image_too_large"), ("corrupt", "bad_image"),
        ("gone", "image_unreachable")]
    rt = open_runtime(vit)
    data = {**images, **{k: get_store(u).get_bytes(u) for k, u in uris.items()}}
    res.sort(key=lambda r: r["record_id"])
    probs = activate(rt.logits(np.stack([rt.preprocessor.to_pixels(decode(data[r["record_id"]], 10**6))
                                         for r in res])), "softmax")
    assert [r["label"] for r in res] == [rt.meta["labels"][i] for i in probs.argmax(1)]
    np.testing.assert_allclose([r["score"] for r in res], probs.max(1), atol=1e-6)
    assert sum(man["counts"]["labels"].values()) == 26
    assert status(jobs["classify_image"])["summary"] == {"labels": man["counts"]["labels"]}
