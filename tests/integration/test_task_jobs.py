"""Tasks score and classify end to end on the embedded default: exactly-once coverage, bad
records as error rows naming the record and the fix, results equal to the runtime's own, the
task's summary in _MANIFEST.json and the status object, and a rerun byte-identical."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchinf.bundles import import_bundle, open_runtime
from batchinf.controller import drive
from batchinf.ledger.states import JobStatus
from batchinf.ledger.status import status
from batchinf.manifest import parse_manifest
from batchinf.runtime.classifier import activate
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from batchinf.verify import MANIFEST, verify_output
from tests.helpers.api_service import rest_status
from tests.helpers.tiny_classifiers import make_tiny_classifier

pytestmark = pytest.mark.integration
WORDS = "the of and to a in is it you that he was for on are with as his they be at one have this".split()


def _text(rng: np.random.Generator, heavy: bool = False) -> str:
    n = int(rng.pareto(1.2) * 4 + 1) if heavy else int(rng.integers(1, 12))
    return " ".join(rng.choice(WORDS, size=min(n, 150)))


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(tmp_path: Path, name: str, task: str, inp: dict, options: dict | None = None) -> tuple[Path, str]:
    out = tmp_path / name
    m = {"name": name, "task": task, "bundle": f"{task}@prod", "output": {"uri": str(out)},
         "input": {"uri": str(tmp_path / "in" / task) + "/", "format": "jsonl", **inp},
         "shards": {"max_records": 40}, "options": options or {}}
    job_id, _ = submit(parse_manifest(m), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
    return out, job_id


def _read(out: Path) -> tuple[list[dict], list[dict]]:
    res = pq.read_table(out, ignore_prefixes=["_", "errors", "openai"]).to_pylist()
    errs = pq.read_table(out / "errors").to_pylist() if (out / "errors").exists() else []
    return res, errs


def test_score_job_pairs_and_lists(tmp_path: Path, bi_home: Path) -> None:
    src = make_tiny_classifier(tmp_path / "ce", num_labels=1, cross_encoder=True, seed=1)
    digest = import_bundle(src, "score", alias="prod").digest
    rng = np.random.default_rng(0)
    pairs = [{"id": f"p{i}", "q": _text(rng), "d": _text(rng, heavy=True)} for i in range(90)]
    bad = [{"id": "noq", "d": "a doc"}, {"id": "emptyd", "q": "query", "d": "  "}]
    _write(tmp_path / "in" / "score" / "pairs.jsonl", pairs[:50] + bad + pairs[50:])
    out, job_id = _run(tmp_path, "pairs", "score", {"query_field": "q", "document_field": "d"})
    res, errs = _read(out)
    assert sorted((e["record_id"], e["error"]) for e in errs) == [("emptyd", "empty_document"),
                                                                  ("noq", "missing_query")]
    assert "input.query_field" in next(e["message"] for e in errs if e["record_id"] == "noq")
    keys = [(r["source"], r["ordinal"]) for r in res + errs]
    assert len(keys) == len(set(keys)) == 92
    rt = open_runtime(digest)
    by_id = {p["id"]: p for p in pairs}
    sample = sorted(res, key=lambda r: r["record_id"])[::7]
    enc = rt.encode([(by_id[r["record_id"]]["q"], by_id[r["record_id"]]["d"]) for r in sample])
    want = activate(rt.logits([e[0] for e in enc], [e[1] for e in enc])[0], "sigmoid")[:, 0]
    np.testing.assert_allclose([r["score"] for r in sample], want, atol=1e-5)
    man = json.loads((out / MANIFEST).read_text())
    assert man["task"] == "score" and sum(man["counts"]["score_histogram"]["counts"]) == 90
    assert verify_output(str(out))["ok"]
    st = status(job_id)
    assert st["task"] == "score" and st["counts"]["records_failed"] == 2
    want = {k: man["counts"][k] for k in ("score_histogram", "scores")}
    assert st["summary"] == want == rest_status(job_id)["summary"] and want["scores"] == 90
    assert len(want["score_histogram"]["edges"]) == len(want["score_histogram"]["counts"]) + 1

    # a rerun of the same input gives byte-identical parts
    out2, _ = _run(tmp_path, "pairs-again", "score", {"query_field": "q", "document_field": "d"})
    shas = [{p["key"]: p["sha256"] for p in json.loads((o / MANIFEST).read_text())["parts"]} for o in (out, out2)]
    assert shas[0] == shas[1]

    # list form: one query, many documents -> scores and ranks in document order, top_n best
    lists = [{"id": f"l{i}", "q": _text(rng), "docs": [_text(rng, heavy=True) for _ in range(1 + i % 5)]}
             for i in range(30)]
    _write(tmp_path / "in" / "score" / "pairs.jsonl", lists + [{"id": "nodocs", "q": "q", "docs": []}])
    out3, _ = _run(tmp_path, "lists", "score", {"query_field": "q", "documents_field": "docs"}, {"top_n": 2})
    res, errs = _read(out3)
    assert [(e["record_id"], e["error"]) for e in errs] == [("nodocs", "empty_documents")]
    row = next(r for r in res if r["record_id"] == "l4")
    doc = {x["id"]: x for x in lists}["l4"]
    enc = rt.encode([(doc["q"], d) for d in doc["docs"]])
    want = activate(rt.logits([e[0] for e in enc], [e[1] for e in enc])[0], "sigmoid")[:, 0]
    np.testing.assert_allclose(row["scores"], want, atol=1e-5)
    assert row["ranks"] == [int(r) + 1 for r in np.argsort(np.argsort(-want, kind="stable"), kind="stable")]
    assert row["top"] == [int(i) for i in np.argsort(-want, kind="stable")[:2]] and row["score"] is None


def test_classify_job_labels(tmp_path: Path, bi_home: Path) -> None:
    src = make_tiny_classifier(tmp_path / "cls", num_labels=3, seed=2)
    digest = import_bundle(src, "classify", alias="prod").digest
    rng = np.random.default_rng(1)
    rows = [{"id": f"t{i}", "text": _text(rng, heavy=True)} for i in range(80)]
    _write(tmp_path / "in" / "classify" / "t.jsonl", rows[:10] + [{"id": "e", "text": ""}] + rows[10:])
    out, job_id = _run(tmp_path, "cls-out", "classify", {}, {"top_k": 2})
    res, errs = _read(out)
    assert [(e["record_id"], e["error"]) for e in errs] == [("e", "empty_text")]
    assert len(res) == 80
    rt = open_runtime(digest)
    by_id = {r["id"]: r["text"] for r in rows}
    enc = rt.encode([by_id[r["record_id"]] for r in res])
    probs = activate(rt.logits([e[0] for e in enc], [e[1] for e in enc])[0], "softmax")
    assert [r["label"] for r in res] == [rt.meta["labels"][i] for i in probs.argmax(1)]
    np.testing.assert_allclose([r["score"] for r in res], probs.max(1), atol=1e-5)
    assert all(len(r["top"]) == 2 and r["top"][0]["label"] == r["label"] for r in res)
    man = json.loads((out / MANIFEST).read_text())
    assert sum(man["counts"]["labels"].values()) == 80
    st = status(job_id)
    assert st["task"] == "classify" and st["summary"] == {"labels": man["counts"]["labels"]}
    assert rest_status(job_id)["summary"] == st["summary"]


def test_rerank_batch_lines(tmp_path: Path, bi_home: Path) -> None:
    """OpenAI-style /v1/rerank lines on a score job: response lines with results best first (the
    line's top_n), scores equal to the runtime's, bad lines as 400 error lines."""
    src = make_tiny_classifier(tmp_path / "ce", num_labels=1, cross_encoder=True, seed=1)
    digest = import_bundle(src, "score", alias="prod").digest
    rng = np.random.default_rng(3)
    bodies = [{"model": "score@prod", "query": _text(rng), "documents": [_text(rng, heavy=True) for _ in range(1 + i % 4)],
               **({"top_n": 2} if i % 2 else {})} for i in range(12)]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/rerank", "body": b} for i, b in enumerate(bodies)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/rerank", "body": {"query": "q", "documents": []}})
    _write(tmp_path / "in" / "rerank" / "batch.jsonl", lines)
    out = tmp_path / "rerank-out"
    m = {"name": "rerank", "task": "score", "bundle": "score@prod", "output": {"uri": str(out)},
         "input": {"uri": str(tmp_path / "in" / "rerank") + "/", "format": "openai-batch"}}
    job_id, _ = submit(parse_manifest(m), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
    assert verify_output(str(out))["ok"]            # re-renders the response lines byte for byte
    got = {r["custom_id"]: r for f in sorted((out / "openai").glob("*.jsonl")) for r in map(json.loads, f.open())}
    assert len(got) == 13 and got["bad"]["response"]["status_code"] == 400
    assert got["bad"]["error"]["code"] == "invalid_documents"
    rt = open_runtime(digest)
    for i, b in enumerate(bodies):
        enc = rt.encode([(b["query"], d) for d in b["documents"]])
        want = activate(rt.logits([e[0] for e in enc], [e[1] for e in enc])[0], "sigmoid")[:, 0]
        order = [int(k) for k in np.argsort(-want, kind="stable")][:b.get("top_n")]
        res = got[f"r{i}"]["response"]["body"]["results"]
        assert [r["index"] for r in res] == order
        np.testing.assert_allclose([r["relevance_score"] for r in res], want[order], atol=1e-5)
