"""Task classify: sequence classification of a text record -> `label` (the best), `score` (its
probability) and `top` (the top_k labels with probabilities, best first). Probabilities are a
softmax over the labels, or a sigmoid per label for multi-label models
(`problem_type: multi_label_classification`), as the model's config says; label names come from
its `id2label`. Staged and batched like embed (length measure: tokens)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
from pydantic import Field

from batchinf.manifest_rules import (BOOLEAN, LIMITED, MAX_LABELS, MAX_LENGTH, Section, choice, nullable,
                                     positive)
from batchinf.tasks.base import RECORD_FIELDS, STAGE_FIELDS, RunOutput, Task, record_columns
from batchinf.tasks.embed import DEVICES, run_sequences, stage_texts

CLASSIFY_STAGE_SCHEMA = pa.schema(STAGE_FIELDS + [("input_ids", pa.list_(pa.int32()))])
TOP = pa.list_(pa.struct([("label", pa.string()), ("score", pa.float32())]))
CLASSIFY_SCHEMA = pa.schema(RECORD_FIELDS + [
    ("label", pa.string()), ("score", pa.float32()), ("top", TOP),
    ("input_tokens", pa.int32()), ("truncated", pa.bool_()),
])


class ClassifyOptions(Section):
    """Options of task classify."""
    max_length: Annotated[int | None, nullable(positive(MAX_LENGTH))] = Field(
        None, description="tokens kept per record; default and ceiling: the bundle's max length")
    max_batch_tokens: Annotated[int, LIMITED] = Field(2048, description="padded tokens per forward batch")
    truncate: Annotated[bool, BOOLEAN] = Field(
        True, description="false: over-long records become error rows (too_long) instead of being truncated")
    top_k: Annotated[int, positive(MAX_LABELS)] = Field(5, description="labels listed in `top`, best first (at most all)")
    device: Annotated[str, choice(DEVICES)] = "auto"


class _Tok:
    """The classifier runtime's tokenizer as stage_texts wants it."""

    def __init__(self, runtime: Any, max_length: int) -> None:
        self.runtime, self.max_length = runtime, max_length

    def encode_batch(self, texts: list[str]) -> list[Any]:
        from batchinf.runtime.tokenizer import Encoded

        return [Encoded(ids, truncated) for ids, _, truncated in self.runtime.encode(texts, self.max_length)]


def top_labels(probs: np.ndarray, labels: list[str], k: int) -> list[list[dict[str, Any]]]:
    """Per row: the k best labels with their probabilities, best first (ties by label index)."""
    out = []
    for row in probs:
        order = sorted(range(len(row)), key=lambda j: (-row[j], j))[:k]
        out.append([{"label": labels[j], "score": float(row[j])} for j in order])
    return out


class Classify(Task):
    name = "classify"
    onnx_output = "logits"
    options = ClassifyOptions
    fields = ("text_field",)
    stage_schema = CLASSIFY_STAGE_SCHEMA
    summary_columns = ("label",)

    def read_as(self, inp: Any) -> tuple[str, str]:
        return inp.text_field, "text"

    def stage(self, obj: Any, runtime: Any, records: Iterator[Any]) -> pa.Table:
        return stage_texts(obj, _Tok(runtime, obj.max_length), records)

    def result_schema(self, meta: dict[str, Any], options: Any = None) -> pa.Schema:
        return CLASSIFY_SCHEMA

    def run(self, c: dict[str, list[Any]], runtime: Any, options: Any, check: Callable[[], None],
            split: Callable[[], bool] | None = None, files: Any = None) -> RunOutput:
        from batchinf.runtime.classifier import activate

        def forward(batch: list[list[int]]) -> tuple[np.ndarray, int]:
            check()
            return runtime.logits(batch, [[0] * len(x) for x in batch])

        ok, logits, out = run_sequences(c, forward, options.max_batch_tokens)
        labels = runtime.meta["labels"]
        probs = activate(logits, runtime.meta["activation"]) if ok else np.zeros((0, len(labels)), np.float32)
        top = top_labels(probs, labels, min(options.top_k, len(labels)))
        table = pa.table({
            **record_columns(c, ok), "label": [t[0]["label"] for t in top], "score": [t[0]["score"] for t in top],
            "top": top, "input_tokens": [c["n_tokens"][i] for i in ok],
            "truncated": [c["truncated"][i] for i in ok],
        }, schema=CLASSIFY_SCHEMA)
        n = sum(c["n_tokens"][i] for i in ok)
        return RunOutput(table, out.failures, {"input": n, "output": 0, "real": n, "padded": out.padded})

    def summarize(self, tables: Iterable[pa.Table]) -> dict[str, Any]:
        """How many records got each label."""
        counts: Counter[str] = Counter()
        for t in tables:
            counts.update(t.column("label").to_pylist())
        return {"labels": dict(sorted(counts.items()))}

    def detects(self, config: dict[str, Any], src: Path) -> bool:
        from batchinf.tasks.classifier_bundle import is_cross_encoder, is_sequence_classifier

        return is_sequence_classifier(config) and not is_cross_encoder(config)

    def build_meta(self, src: Path, files: list[str], *, max_length: int | None, dtype: str) -> dict[str, Any]:
        from batchinf.runtime.bundle import FIXTURE_TEXTS
        from batchinf.tasks.classifier_bundle import build_classifier_meta

        return build_classifier_meta(src, files, task=self.name, max_length=max_length, dtype=dtype,
                                     fixture_inputs=list(FIXTURE_TEXTS))

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
