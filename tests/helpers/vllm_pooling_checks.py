"""The vllm engine's pooling checks (embed, score), run inside the vllm venv (tests/helpers/vllm_env.py)
by tests/integration/test_vllm_pooling.py, in one process: prints one JSON object.

- the real all-MiniLM-L6-v2 bundle opens on vllm (its embedding fixtures replayed through vLLM's
  pooling runner at load); its vectors for texts short and long (truncated at the bundle's max
  length) against native's: the least cosine;
- the same bundle with its pooling said to be CLS (what vLLM would do if the bundle's mean pooling
  were not applied) is refused at load, naming the fixture that differs;
- a tiny random BERT cross-encoder (head size 64, which vLLM's CPU attention takes) opens on vllm
  (its logit fixtures replayed); its logits for (query, document) pairs against native's: the
  largest relative difference; a fixture recorded otherwise is refused naming it;
- a tiny random BERT classifier (3 labels) opens on vllm for task classify; its logits against native's;
- an embed job and a score job with `engine: vllm` run end to end in a worker process and publish
  the same rows as the same jobs on native (ids, token counts, truncation; vectors by cosine, scores
  within tolerance).

    python -m tests.helpers.vllm_pooling_checks HOME_DIR MINILM_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

TEXTS = ["the people of the world", "water and light", "a", "every day of the year " * 60,
         "Hello, World! Ünïcödé text — with punctuation.", "make the world light of the people"]
PAIRS = [("the world", "the people of the world"), ("water", "light of the year"), ("day", "every day"),
         ("make the world", "water and light of the people " * 5)]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _published(out: Path) -> dict[str, dict[str, Any]]:
    from batchinf.parts import read_table
    from batchinf.verify import MANIFEST

    m = json.loads((out / MANIFEST).read_text())
    return {r["record_id"]: r for p in m["parts"] if p["kind"] == "results"
            for r in read_table(str(out / p["key"])).to_pylist()}


def _job(home: Path, name: str, task: str, bundle: str, engine: str, inp: Path, extra: dict[str, Any]) -> dict:
    from batchinf.controller import drive
    from batchinf.ledger.jobs import get as job_row
    from batchinf.manifest import parse_manifest
    from batchinf.scopes import Caller
    from batchinf.submit import submit

    out = home.parent / "out" / name
    raw = {"name": name, "task": task, "bundle": bundle, "engine": engine, "input": {"uri": str(inp), **extra},
           "output": {"uri": str(out)}, "shards": {"max_records": 3}}
    job_id, _ = submit(parse_manifest(raw), Caller("default", operator=True))
    final = drive(job_id, workers=1, threads=1)
    if final != "succeeded":
        return {"status": f"{final}: {job_row(job_id).error}"}
    return {"status": final, "rows": _published(out)}


def main(home: Path, minilm: Path) -> dict[str, Any]:
    os.environ["BATCHINF_HOME"] = str(home)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name in ("BATCHINF_DATABASE_URL", "BATCHINF_BUNDLE_STORE"):
        os.environ.pop(name, None)
    from batchinf.bundles import import_bundle, local_dir, open_runtime
    from batchinf.engines.vllm_pooling import VllmClassifierRuntime, VllmEmbedRuntime
    from batchinf.errors import BundleError
    from tests.helpers.tiny_classifiers import make_tiny_classifier

    report: dict[str, Any] = {}
    # --- embed: the real MiniLM ---------------------------------------------------------------------
    digest = import_bundle(minilm, "minilm", alias="prod").digest
    native = open_runtime(digest)
    rt = open_runtime(digest, engine="vllm")                  # fixtures replayed through vLLM here
    report["embed_engine"] = getattr(rt, "engine", "native")
    report["embed_pooling"] = [rt.meta["pooling"], rt.meta["normalize"]]
    ids = [native.tokenizer.encode(t).ids for t in TEXTS]     # truncated at the bundle's max length
    report["embed_longest"] = [max(map(len, ids)), rt.meta["max_length"]]
    ours, _ = rt.embed(ids)
    theirs, _ = native.embed(ids)
    report["embed_min_cosine"] = float(_cosines(ours, theirs).min())
    report["embed_norms"] = [float(x) for x in np.linalg.norm(ours, axis=1)]
    try:                                                      # a pooler that does not pool as the bundle pinned
        VllmEmbedRuntime(local_dir(digest), {**rt.meta, "pooling": "cls"}).verify_fixtures()
        report["embed_drift_refused"] = "accepted"
    except BundleError as exc:
        report["embed_drift_refused"] = str(exc)

    # --- score: a tiny BERT cross-encoder -----------------------------------------------------------
    ce = make_tiny_classifier(home.parent / "ce", num_labels=1, cross_encoder=True, seed=1, hidden=128, heads=2)
    ce_digest = import_bundle(ce, "ce", alias="prod").digest
    ce_native = open_runtime(ce_digest)
    ce_rt = open_runtime(ce_digest, engine="vllm")
    report["score_engine"] = getattr(ce_rt, "engine", "native")
    enc = ce_native.encode(PAIRS)
    report["score_pair_types"] = any(any(t) for _, t, _ in enc)   # the second segment's token types reach vLLM
    got, _ = ce_rt.logits([e[0] for e in enc], [e[1] for e in enc])
    want, _ = ce_native.logits([e[0] for e in enc], [e[1] for e in enc])
    report["score_max_rel_diff"] = float((np.abs(got - want).max(1) / np.maximum(1.0, np.abs(want).max(1))).max())
    drifted = VllmClassifierRuntime(local_dir(ce_digest), {**ce_rt.meta, "fixtures": [
        {**f, "logits": [x + 0.5 for x in f["logits"]]} if i == 1 else f for i, f in enumerate(ce_rt.meta["fixtures"])]})
    drifted.model = ce_rt.model                               # the same vLLM engine, another recording
    try:
        drifted.verify_fixtures()
        report["score_drift_refused"] = "accepted"
    except BundleError as exc:
        report["score_drift_refused"] = str(exc)

    # --- classify: a tiny BERT classifier, single texts ----------------------------------------------
    cls = make_tiny_classifier(home.parent / "cls", num_labels=3, seed=2, hidden=128, heads=2)
    cls_digest = import_bundle(cls, "cls", alias="prod").digest
    cls_native, cls_rt = open_runtime(cls_digest), open_runtime(cls_digest, engine="vllm")
    report["classify_engine"] = getattr(cls_rt, "engine", "native")
    enc = cls_native.encode(TEXTS)
    got, _ = cls_rt.logits([e[0] for e in enc], [e[1] for e in enc])
    want, _ = cls_native.logits([e[0] for e in enc], [e[1] for e in enc])
    report["classify_max_rel_diff"] = float((np.abs(got - want).max(1) / np.maximum(1.0, np.abs(want).max(1))).max())

    # --- jobs on vllm against the same jobs on native -----------------------------------------------
    emb_in = home.parent / "embed.jsonl"
    emb_in.write_text("".join(json.dumps({"id": f"e{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    score_in = home.parent / "score.jsonl"
    score_in.write_text("".join(json.dumps({"id": f"s{i}", "query": q, "document": d}) + "\n"
                                for i, (q, d) in enumerate(PAIRS)))
    jobs = {(task, engine): _job(home, f"{task}-{engine}", task, bundle, engine, inp, extra)
            for task, bundle, inp, extra in (("embed", "minilm@prod", emb_in, {}),
                                              ("score", "ce@prod", score_in, {"query_field": "query"}))
            for engine in ("vllm", "native")}
    report["jobs"] = {f"{t}-{e}": j["status"] for (t, e), j in jobs.items()}
    if all(j["status"] == "succeeded" for j in jobs.values()):
        for task, value, same in (("embed", "embedding", "cosine"), ("score", "score", "diff")):
            v, n = jobs[(task, "vllm")]["rows"], jobs[(task, "native")]["rows"]
            fields = [k for k in next(iter(n.values())) if k != value]
            report[f"{task}_job_same_ids"] = sorted(v) == sorted(n)
            report[f"{task}_job_same_fields"] = all({k: v[r][k] for k in fields} == {k: n[r][k] for k in fields}
                                                    for r in n if r in v)
            a = np.asarray([v[r][value] for r in sorted(n) if r in v], dtype=np.float64).reshape(len(v), -1)
            b = np.asarray([n[r][value] for r in sorted(n) if r in v], dtype=np.float64).reshape(len(v), -1)
            report[f"{task}_job_{same}"] = float(_cosines(a, b).min()) if same == "cosine" \
                else float(np.abs(a - b).max())
    return report


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2]))))
