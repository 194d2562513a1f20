"""A whole embedded job on the real all-MiniLM-L6-v2 bundle matches sentence-transformers."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchinf.bundles import import_bundle
from batchinf.controller import drive
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.manifest import parse_manifest
from tests.helpers.corpus import manifest, texts

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_job_embeddings_match_sentence_transformers(tmp_path: Path, bi_home: Path, minilm_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    import_bundle(minilm_dir, "minilm", alias="prod")
    corpus = texts(240, seed=11)
    corpus += [" ".join(["Long documents run past the two hundred and fifty six token limit."] * k)
               for k in (30, 45, 80)]                                     # truncated at max_length
    corpus += ["Ünïcödé — 中文, emoji 🚀, and RTL שלום."]
    with open(tmp_path / "in.jsonl", "w") as f:
        for i, t in enumerate(corpus):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
        f.write("{broken\n")
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(manifest(str(tmp_path / "in.jsonl"), str(out), bundle="minilm@prod",
                                               shards={"max_records": 64})), OPERATOR)
    assert drive(job_id, workers=1) == "succeeded"

    rows = pq.read_table(out, ignore_prefixes=["_", "errors"]).to_pylist()
    assert len(rows) == len(corpus)
    rows.sort(key=lambda r: int(r["record_id"]))
    got = np.asarray([r["embedding"] for r in rows], dtype=np.float32)
    want = SentenceTransformer(str(minilm_dir), device="cpu").encode(corpus, batch_size=32)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999, f"record {int(cos.argmin())} cosine {cos.min()}"
    assert [r["truncated"] for r in rows[-4:-1]] == [True, True, True]
    assert all(r["input_tokens"] == 256 for r in rows[-4:-1])
    assert pq.read_table(out / "errors").column("error").to_pylist() == ["malformed_json"]
