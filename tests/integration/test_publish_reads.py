"""Publishing on S3 reads each committed part once: its digest, row count, coverage, the task's
summary and its OpenAI rendering all come from one local copy (the promotion is a server-side
copy). Counted at the S3 client: every GetObject of a part, by key."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from batchinf.bundles import import_bundle
from batchinf.ledger import jobs, shards
from batchinf.ledger.states import JobStatus
from batchinf.lifecycle import step
from batchinf.manifest import parse_manifest
from batchinf.store import get_store, join
from batchinf.store.s3 import client
from batchinf.submit import submit
from batchinf.verify import MANIFEST, verify_output
from tests.helpers.corpus import manifest, write_jsonl
from tests.helpers.env import OPERATOR
from tests.helpers.stages import InProcess, publish_job
from tests.helpers.tiny_classifiers import make_tiny_classifier

pytestmark = pytest.mark.integration


@pytest.fixture
def gets() -> Iterator[Counter[str]]:
    """GetObject calls of this process's S3 client, by key, while the test counts them."""
    seen: Counter[str] = Counter()
    events = client().meta.events

    def count(params: dict[str, Any], **_: Any) -> None:
        seen[params["Key"]] += 1
    events.register("before-parameter-build.s3.GetObject", count)
    try:
        yield seen
    finally:
        events.unregister("before-parameter-build.s3.GetObject", count)


def _to_verifying(job_id: str) -> None:
    d = InProcess()
    for _ in range(50):
        if jobs.get(job_id).status == JobStatus.VERIFYING:
            return
        step(job_id, d)
    raise AssertionError(f"job {job_id} is {jobs.get(job_id).status}: {jobs.get(job_id).error}")


def _parts(job_id: str) -> list[str]:
    """The committed parts (files with rows) of the job's shards."""
    return [uri for sh in shards.of_job(job_id)
            for uri, rows in ((sh.output_uri, sh.output_rows), (sh.errors_uri, sh.error_rows)) if uri and rows]


def _reads_per_part(gets: Counter[str], job_id: str, bucket: str) -> list[int]:
    """GETs of each committed part during publish: of its attempt's file plus of its promoted copy."""
    out = jobs.get(job_id).output_uri
    listed = [p for p in json.loads(get_store(out).get_bytes(join(out, MANIFEST)))["parts"] if p["kind"] != "openai"]
    key = {p["shard"] + p["kind"]: join(out, p["key"]).removeprefix(bucket + "/") for p in listed}
    return [gets[uri.removeprefix(bucket + "/")] + gets[key[sh.id + kind]]
            for sh in shards.of_job(job_id)
            for kind, uri, rows in (("results", sh.output_uri, sh.output_rows), ("errors", sh.errors_uri, sh.error_rows))
            if uri and rows]


def _lines(src: Path, url: str, body: Callable[[int], dict[str, Any]]) -> None:
    src.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body(i)}) + "\n"
                           for i in range(59)) + "not json\n")


@pytest.mark.parametrize("fmt", ["jsonl", "openai-batch", "rerank"])
def test_publish_reads_each_part_once(tmp_path: Path, tiny_bundle: str, s3_bucket: str,
                                      gets: Counter[str], fmt: str) -> None:
    """jsonl embed: digest and coverage; openai-batch embed: and the rendering; rerank (task
    score through /v1/rerank lines): and the score histogram too."""
    src = tmp_path / "in.jsonl"
    m = manifest(str(src), f"{s3_bucket}/out-{fmt}/", shards={"max_records": 20})
    if fmt == "jsonl":
        write_jsonl(src, 60, bad=True)
    elif fmt == "openai-batch":
        _lines(src, "/v1/embeddings", lambda i: {"input": f"text {i}"})
        m["input"]["format"] = "openai-batch"
    else:
        import_bundle(make_tiny_classifier(tmp_path / "ce", num_labels=1, cross_encoder=True, seed=1), "score",
                      alias="prod")
        _lines(src, "/v1/rerank", lambda i: {"model": "score@prod", "query": f"q {i}", "documents": ["a fox", "b"]})
        m.update(task="score", bundle="score@prod")
        m["input"]["format"] = "openai-batch"
    job_id, _ = submit(parse_manifest(m), OPERATOR)
    _to_verifying(job_id)
    parts = _parts(job_id)
    assert len(parts) >= 3
    gets.clear()
    publish_job(job_id)
    reads = _reads_per_part(gets, job_id, s3_bucket)
    print(f"{fmt}: {len(parts)} parts, GETs per part during publish: {sum(reads) / len(parts):.1f}")
    assert max(reads) <= 1, reads
    assert verify_output(jobs.get(job_id).output_uri)["ok"]
