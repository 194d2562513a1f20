"""A job's embedding prompt: `options.prompt_name` picks one of the bundle's sentence-transformers
prompts (pinned in bundle.json) and the job's vectors equal sentence-transformers' `encode` with
that prompt, through Dense and Normalize; an unknown prompt name fails the job naming the
bundle's prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchinf.bundles import import_bundle
from batchinf.controller import drive
from batchinf.ledger import jobs as job_repo
from batchinf.ledger.states import JobStatus
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from tests.helpers.corpus import manifest
from tests.helpers.tiny_st import PROMPTS, make_st_bert

pytestmark = pytest.mark.integration

TEXTS = [f"the {w} of the world is {i} times a good word" for i, w in enumerate(["water", "earth", "air"] * 7)]


def test_prompt_name_through_a_job(tmp_path: Path, bi_home: Path) -> None:
    from sentence_transformers import SentenceTransformer

    d = make_st_bert(tmp_path / "st", ["mean", "max"], dense_out=16, prompts=PROMPTS)
    import_bundle(d, "st", alias="prod")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n"
                                               for i, t in enumerate(TEXTS)))
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in.jsonl"), str(out), bundle="st@prod",
                                               options={"prompt_name": "passage"})), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
    rows = sorted(pq.read_table(out, ignore_prefixes=["_", "errors"]).to_pylist(), key=lambda r: int(r["record_id"][1:]))
    got = np.array([r["embedding"] for r in rows], dtype=np.float32)
    want = SentenceTransformer(str(d), device="cpu").encode(TEXTS, prompt_name="passage")
    assert np.abs(got - want).max() <= 1e-5

    bad, _ = submit(parse_manifest(manifest(str(tmp_path / "in.jsonl"), str(tmp_path / "out2"), bundle="st@prod",
                                            options={"prompt_name": "document"})), OPERATOR)
    assert drive(bad, workers=1, threads=1) == JobStatus.FAILED
    error = job_repo.get(bad).error or ""
    assert "'document' is not a prompt of this bundle" in error and "passage, query" in error, error
