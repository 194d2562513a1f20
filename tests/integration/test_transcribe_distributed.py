"""Task transcribe in distributed mode with the real tiny.en: a controller and two Celery
workers as real processes over PostgreSQL, Redis and the S3 server; audio objects on S3, one of
them a long file staged in pieces over several shards (`shards.max_tokens`); a worker process
holding a shard's lease is killed with SIGKILL mid-job. The job still succeeds, every file is
covered exactly once (a transcript, or the error row of the bad one; the long file one row
stitched from its pieces), and the transcripts are the ones an embedded run gives for the same
files."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from batchinf.bundles import import_bundle
from batchinf.ledger.status import status
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from batchinf.store import get_store
from batchinf.submit import submit
from batchinf.verify import verify_output
from tests.helpers.cluster import Cluster, leased_worker_pid, wait
from tests.helpers.env import OPERATOR
from tests.helpers.real_models import whisper_tiny_en_dir
from tests.helpers.speech import clips, long_clip, wer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_transcribe_on_a_cluster_with_a_worker_killed(cluster: Cluster, s3_bucket: str) -> None:
    import_bundle(whisper_tiny_en_dir(), "tiny-en", alias="prod")
    material = clips()[:10]
    for name, _, wav in material:
        get_store(s3_bucket).put_bytes(f"{s3_bucket}/in/{name}", wav)
    get_store(s3_bucket).put_bytes(f"{s3_bucket}/in/broken.wav", b"RIFF\x00\x00")
    long_text, long_wav = long_clip(0)          # 157 s: three pieces of two windows, a shard each
    get_store(s3_bucket).put_bytes(f"{s3_bucket}/in/long.wav", long_wav)
    m = {"name": "dist-transcribe", "task": "transcribe", "bundle": "tiny-en@prod", "output": {"uri": f"{s3_bucket}/out/"},
         "input": {"uri": f"{s3_bucket}/in/", "format": "audio"}, "shards": {"max_records": 2, "max_tokens": 60},
         "options": {"max_batch_windows": 4}}
    job_id = submit(parse_manifest(m), OPERATOR)[0]
    cluster.controller()
    cluster.worker("w1")
    cluster.worker("w2")
    killed = None
    deadline = time.monotonic() + 240
    while killed is None and time.monotonic() < deadline and status(job_id)["status"] not in ("succeeded", "failed"):
        if (pid := leased_worker_pid()) is not None:
            try:
                os.kill(pid, signal.SIGKILL)
                killed = pid
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    assert killed is not None, f"no worker held a lease to kill\n{cluster.log_tail()}"
    assert wait(job_id, cluster, timeout=300)["status"] == "succeeded", cluster.log_tail()

    out = f"{s3_bucket}/out/"
    assert verify_output(out)["ok"]
    manifest = json.loads(get_store(out).get_bytes(f"{out}_MANIFEST.json"))
    rows, errors = [], []
    for p in manifest["parts"]:
        t = read_table(f"{out}{p['key']}").to_pylist()
        (rows if p["kind"] == "results" else errors).extend(t)
    assert sorted(r["record_id"] for r in rows) == sorted([name for name, _, _ in material] + ["long.wav"])  # once
    assert [(e["record_id"], e["error"]) for e in errors] == [("broken.wav", "not_audio")]
    got = {r["record_id"]: r["text"] for r in rows}
    assert wer([t for _, t, _ in material], [got[n] for n, _, _ in material]) <= 0.1
    assert manifest["counts"]["records_total"] == 12 and manifest["counts"]["records_failed"] == 1
    long = next(r for r in rows if r["record_id"] == "long.wav")
    times = [x for s in long["segments"] for x in (s["start"], s["end"])]
    assert times == sorted(times) and times[-1] >= long["duration_seconds"] - 5 and wer([long_text], [got["long.wav"]]) <= 0.15
    assembled = [p for p in manifest["parts"] if "assembled_from" in p]
    assert [p["rows"] for p in assembled] == [1] and len(assembled[0]["assembled_from"]) >= 3
    assert manifest["counts"]["pieces"]["records"] == 1
    st = status(job_id)["counts"]
    assert (st["records_done"], st["records_succeeded"], st["records_failed"]) == (12, 11, 1)
