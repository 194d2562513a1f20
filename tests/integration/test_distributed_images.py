"""Task generate_image in distributed mode with a worker killed: a controller and two Celery
workers over PostgreSQL, Redis and the S3 server; the pool process holding a shard's lease is
killed with SIGKILL mid-denoise (each step slowed by a failpoint) and a third worker joins. Every
record is covered exactly once, the bad one is its error row, every listed image on S3 re-hashes
to its manifest digest, and each image equals diffusers' own for the record's seed."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from batchinf.bundles import import_bundle
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from batchinf.runtime.diffusion.png import to_uint8
from batchinf.store import get_store
from batchinf.submit import submit
from batchinf.verify import verify_output
from tests.helpers.cluster import Cluster, leased_worker_pid, wait
from tests.helpers.env import OPERATOR
from tests.helpers.tiny_diffusion import make_tiny_pipeline, reference_images, reference_pipeline

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_images_on_a_cluster_with_a_worker_killed(cluster: Cluster, tmp_path: Path, s3_bucket: str) -> None:
    from PIL import Image

    src = make_tiny_pipeline(tmp_path / "sd")
    import_bundle(src, "sd", alias="prod")
    records = [{"id": f"r{i}", "prompt": "a red cat" if i % 2 else "blue sky", "width": 32 if i % 3 else 64,
                "height": 32, "seed": i} for i in range(8)] + [{"id": "bad", "prompt": ""}]
    inp = f"{s3_bucket}/in-images/a.jsonl"
    get_store(inp).put_bytes(inp, "".join(json.dumps(r) + "\n" for r in records).encode())
    out = f"{s3_bucket}/out-images/"
    m = {"name": "dist-images", "task": "generate_image", "bundle": "sd@prod", "output": {"uri": out},
         "input": {"uri": f"{s3_bucket}/in-images/", "format": "jsonl"}, "shards": {"max_records": 2},
         "options": {"steps": 3, "max_batch_images": 2}}
    job_id = submit(parse_manifest(m), OPERATOR)[0]
    cluster.controller()
    cluster.worker("w1", BATCHINF_FAILPOINTS="execute.image_step=sleep(0.5)")
    deadline = time.monotonic() + 240
    while (pid := leased_worker_pid()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid is not None, cluster.log_tail()
    time.sleep(0.7)                     # into its denoising steps
    os.kill(pid, signal.SIGKILL)
    cluster.worker("w2")
    assert wait(job_id, cluster, timeout=400)["status"] == "succeeded", cluster.log_tail()

    report = verify_output(out)         # parts, coverage, and every image's sha256
    assert report["counts"]["records_failed"] == 1 and report["files"] == 8
    man = json.loads(get_store(out).get_bytes(out + "_MANIFEST.json"))
    rows = [r for p in man["parts"] if p["kind"] == "results" for r in read_table(out + p["key"]).to_pylist()]
    assert sorted(r["record_id"] for r in rows) == sorted(r["id"] for r in records[:8])
    ref = reference_pipeline(src)
    by_id = {r["id"]: r for r in records}
    for row in rows:
        r = by_id[row["record_id"]]
        want = reference_images(ref, [r], width=r["width"], height=r["height"], num_inference_steps=3,
                                guidance_scale=7.5)
        got = np.asarray(Image.open(io.BytesIO(get_store(out).get_bytes(row["image_uris"][0]))).convert("RGB"))
        assert np.abs(got.astype(int) - to_uint8(want[0]).astype(int)).max() <= 1
