"""Task score: cross-encoder reranking and pair scoring. A record is one (query, document) pair
(`input.query_field`, `input.document_field`) -> `score`, or one query with a list of documents
(`input.documents_field`) -> `scores` and `ranks` in document order (rank 1 = best), and with
`options.top_n` the indices of the best `top`. Every pair is a unit of work: staged as token ids
(length measure: the record's pair tokens), run in token-budget batches sorted by pair length."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
from pydantic import Field

from batchinf.openai.lines import RERANK
from batchinf.manifest_rules import (BOOLEAN, LIMITED, MAX_LABELS, MAX_LENGTH, Section, choice, nullable,
                                     positive)
from batchinf.tasks.base import (RECORD_FIELDS, STAGE_FIELDS, RunOutput, StagedRows, Task, chunks, ok_rows,
                                 record_columns, usable_records)
from batchinf.tasks.batching import run_units
from batchinf.tasks.embed import DEVICES

SCORE_STAGE_SCHEMA = pa.schema(STAGE_FIELDS + [
    ("form", pa.string()),                                   # pair | list
    ("pair_ids", pa.list_(pa.list_(pa.int32()))), ("pair_types", pa.list_(pa.list_(pa.int8()))),
    ("top_n", pa.int32()),                                   # a /v1/rerank line's own top_n
])
SCORE_SCHEMA = pa.schema(RECORD_FIELDS + [
    ("score", pa.float32()),                                 # pair form
    ("scores", pa.list_(pa.float32())), ("ranks", pa.list_(pa.int32())),   # list form, document order
    ("top", pa.list_(pa.int32())),                           # list form with top_n: best documents' indices
    ("input_tokens", pa.int32()), ("truncated", pa.bool_()),
])
HISTOGRAM_BINS = 10
# Pair lengths are heavy-tailed; batches at least this full (real / padded tokens) cost a few
# more, smaller batches at the tail, which a cross-encoder's GEMMs absorb (about 0.99 efficient).
MIN_FILL = 0.98


class ScoreOptions(Section):
    """Options of task score."""
    max_length: Annotated[int | None, nullable(positive(MAX_LENGTH))] = Field(
        None, description="tokens kept per pair (query + document); default and ceiling: the bundle's")
    max_batch_tokens: Annotated[int, LIMITED] = Field(4096, description="padded tokens per forward batch")
    truncate: Annotated[bool, BOOLEAN] = Field(
        True, description="false: an over-long pair makes its record a too_long error row")
    top_n: Annotated[int | None, nullable(positive(MAX_LABELS))] = Field(
        None, description="list form: also give the indices of the top_n best documents (`top`)")
    device: Annotated[str, choice(DEVICES)] = "auto"


def _text(fields: dict[str, Any], name: str, what: str, where: str, key: str) -> tuple[str | None, tuple[str, str]]:
    value = fields.get(name)
    if value is None:
        return None, (f"missing_{what}", f"{where} has no {what} field {name!r} (set input.{key} if it has "
                                         "another name)")
    if not isinstance(value, str):
        return None, (f"invalid_{what}", f"{where} field {name!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        return None, (f"empty_{what}", f"{where} has an empty {what}; nothing to score")
    return value, ("", "")


def _documents(fields: dict[str, Any], name: str, where: str) -> tuple[list[str] | None, tuple[str, str]]:
    docs = fields.get(name)
    if docs is None:
        return None, ("missing_documents", f"{where} has no documents field {name!r} (set input.documents_field "
                                           "if it has another name)")
    if not isinstance(docs, list):
        return None, ("invalid_documents", f"{where} field {name!r} must be a list of strings, got "
                                           f"{type(docs).__name__}")
    if not docs:
        return None, ("empty_documents", f"{where} has an empty documents list; give at least one document")
    for k, d in enumerate(docs):
        if not isinstance(d, str) or not d.strip():
            return None, ("invalid_documents", f"{where} document {k} must be a non-empty string, got {d!r:.40}")
    return docs, ("", "")


class Score(Task):
    name = "score"
    onnx_output = "logits"
    options = ScoreOptions
    fields = ("query_field", "document_field", "documents_field")
    stage_schema = SCORE_STAGE_SCHEMA
    summary_columns = ("score", "scores")

    def input_problem(self, inp: Any) -> str | None:
        if inp.document_field and inp.documents_field:
            return ("input: give document_field (one pair per record) or documents_field (a query and its "
                    "list of documents), not both")
        return super().input_problem(inp)

    def stage(self, obj: Any, runtime: Any, records: Iterator[Any]) -> pa.Table:
        inp = obj.input
        qf, df, lf = inp.query_field or "query", inp.document_field or "document", inp.documents_field
        staged = StagedRows(SCORE_STAGE_SCHEMA)
        for chunk in chunks(records):     # pairs are encoded a chunk of records at a time
            rows: list[dict[str, Any]] = []
            pairs: list[tuple[dict[str, Any], list[tuple[str, str]]]] = []
            for row, r, where in usable_records(obj, chunk, rows):
                fields = r.fields or {}
                listed = "documents" if r.endpoint == RERANK else lf     # a rerank line: one query, its documents
                query, (code, msg) = _text(fields, qf, "query", where, "query_field")
                docs: list[str] | None = None
                if query is not None:
                    if listed:
                        docs, (code, msg) = _documents(fields, listed, where)
                    else:
                        doc, (code, msg) = _text(fields, df, "document", where, "document_field")
                        docs = None if doc is None else [doc]
                if docs is None:
                    row.update(error=code, message=msg)
                    continue
                row.update(form="list" if listed else "pair", top_n=(r.params or {}).get("top_n"))
                pairs.append((row, [(query, d) for d in docs]))
            flat = [p for _, ps in pairs for p in ps]
            encoded = iter(runtime.encode(flat, obj.max_length)) if flat else iter(())
            for row, ps in pairs:
                enc = [next(encoded) for _ in ps]
                truncated = any(e[2] for e in enc)
                if truncated and not obj.truncate:
                    row.update(error="too_long", message=(
                        f"{obj.pin.uri} record {row['record_id']!r}: a query + document pair is longer than max_length "
                        f"{obj.max_length} tokens; shorten it or set options.truncate: true"), form=None)
                    continue
                row.update(n_tokens=sum(len(e[0]) for e in enc), truncated=truncated,
                           pair_ids=[e[0] for e in enc], pair_types=[e[1] for e in enc])
            for row in rows:
                staged.append(row)
        return staged.table()

    def result_schema(self, meta: dict[str, Any], options: Any = None) -> pa.Schema:
        return SCORE_SCHEMA

    def run(self, c: dict[str, list[Any]], runtime: Any, options: Any, check: Callable[[], None],
            split: Callable[[], bool] | None = None, files: Any = None) -> RunOutput:
        from batchinf.runtime.classifier import activate

        valid = ok_rows(c)
        owner, ids, types = [], [], []
        for i in valid:
            for pid, pty in zip(c["pair_ids"][i], c["pair_types"][i]):
                owner.append(i)
                ids.append(pid)
                types.append(pty)

        def forward(units: list[int]) -> tuple[np.ndarray, int]:
            check()
            return runtime.logits([ids[u] for u in units], [types[u] for u in units])

        out = run_units(forward, [len(x) for x in ids], list(range(len(ids))),
                        [c["record_id"][i] for i in owner], options.max_batch_tokens, MIN_FILL)
        failures: dict[int, str] = {}
        for u, msg in out.failures.items():
            failures.setdefault(owner[u], msg)
        done = [u for u in range(len(ids)) if owner[u] not in failures]
        scores = activate(np.stack([out.vectors[u] for u in done]), runtime.meta["activation"])[:, 0] \
            if done else np.zeros(0, np.float32)
        per_row: dict[int, list[float]] = {}
        for u, v in zip(done, scores.tolist()):
            per_row.setdefault(owner[u], []).append(v)
        ok = [i for i in valid if i not in failures]
        table = pa.table({**record_columns(c, ok), **_score_columns(c, ok, per_row, options.top_n),
                          "input_tokens": [c["n_tokens"][i] for i in ok],
                          "truncated": [c["truncated"][i] for i in ok]}, schema=SCORE_SCHEMA)
        n = sum(c["n_tokens"][i] for i in ok)
        return RunOutput(table, failures, {"input": n, "output": 0, "real": n, "padded": out.padded})

    def summarize(self, tables: Iterable[pa.Table]) -> dict[str, Any]:
        """A histogram of the scores (pair form: `score`; list form: every document's)."""
        values: list[float] = []
        for t in tables:
            values += [v for v in t.column("score").to_pylist() if v is not None]
            values += [v for vs in t.column("scores").to_pylist() if vs for v in vs]
        if not values:
            return {"score_histogram": {"edges": [], "counts": []}, "scores": 0}
        counts, edges = np.histogram(np.asarray(values, dtype=np.float64), bins=HISTOGRAM_BINS)
        return {"score_histogram": {"edges": [round(float(e), 6) for e in edges], "counts": counts.tolist()},
                "scores": len(values)}

    def detects(self, config: dict[str, Any], src: Path) -> bool:
        from batchinf.tasks.classifier_bundle import is_cross_encoder, is_sequence_classifier

        return is_sequence_classifier(config) and is_cross_encoder(config)

    def build_meta(self, src: Path, files: list[str], *, max_length: int | None, dtype: str) -> dict[str, Any]:
        from batchinf.runtime.bundle import FIXTURE_TEXTS
        from batchinf.tasks.classifier_bundle import build_classifier_meta

        pairs = [(FIXTURE_TEXTS[i], FIXTURE_TEXTS[j]) for i, j in ((0, 1), (1, 0), (2, 0), (0, 3))]
        return build_classifier_meta(src, files, task=self.name, max_length=max_length, dtype=dtype,
                                     fixture_inputs=pairs)

    def open_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        from batchinf.runtime.classifier import ClassifierRuntime

        return ClassifierRuntime(root, meta, device=device)

    def vllm_problem(self, meta: dict[str, Any]) -> str | None:
        from batchinf.engines.vllm_pooling import classifier_problem

        return classifier_problem(meta)

    def vllm_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        from batchinf.engines.vllm_pooling import VllmClassifierRuntime

        return VllmClassifierRuntime(root, meta, device=device)

    def onnx_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        from batchinf.runtime.onnx_classifier import OrtClassifierRuntime

        return OrtClassifierRuntime(root, meta, device=device)

    def verify_model(self, runtime: Any) -> None:
        from batchinf.runtime.classifier import verify_logit_fixtures

        verify_logit_fixtures(runtime)


def _score_columns(c: dict[str, list[Any]], ok: list[int], per_row: dict[int, list[float]],
                   top_n: int | None) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {"score": [], "scores": [], "ranks": [], "top": []}
    for i in ok:
        s = per_row[i]
        if c["form"][i] == "pair":
            cols["score"].append(s[0])
            cols["scores"].append(None)
            cols["ranks"].append(None)
            cols["top"].append(None)
            continue
        order = sorted(range(len(s)), key=lambda k: (-s[k], k))     # best first, ties by document order
        ranks = [0] * len(s)
        for r, k in enumerate(order, start=1):
            ranks[k] = r
        cols["score"].append(None)
        cols["scores"].append(s)
        cols["ranks"].append(ranks)
        n = c["top_n"][i] or top_n
        cols["top"].append(order[:n] if n else None)
    return cols
