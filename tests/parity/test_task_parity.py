"""Parity of the score and classify runtimes against transformers and sentence-transformers, on
tiny random-weight models written by transformers: scores and probabilities within 1e-4, the
same token ids, identical labels. Each model goes through bundle import (fixtures pinned) and
open_runtime (fixtures re-checked) first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from batchinf.bundles import import_bundle, open_runtime
from batchinf.runtime.classifier import activate
from tests.helpers.tiny_classifiers import make_tiny_classifier

PAIRS = [("hello world", "the water is good"), ("a b c", "one two three four five six"), ("x", "y z"),
         ("what is the model", " ".join(["batch text data"] * 60)), ("Ünïcödé 中文", "emoji 🚀 and more words")]
TEXTS = ["hello world", "the water is good for people", "a", " ".join(["long text"] * 80), "Ünïcödé 中文 🚀"]

pytestmark = pytest.mark.parity


def _ours(digest: str, inputs: list) -> tuple[np.ndarray, list]:
    rt = open_runtime(digest)
    enc = rt.encode(inputs)
    logits, _ = rt.logits([e[0] for e in enc], [e[1] for e in enc])
    return activate(logits, rt.meta["activation"]), enc


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_match_sentence_transformers(tmp_path: Path, bi_home: Path, family: str) -> None:
    from sentence_transformers import CrossEncoder

    src = make_tiny_classifier(tmp_path / family, family=family, num_labels=1, cross_encoder=True, seed=3)
    info = import_bundle(src, "ce", alias="prod")
    assert info.task == "score" and info.family == family
    ce = CrossEncoder(str(src), device="cpu")
    want = ce.predict(PAIRS, batch_size=2)
    got, enc = _ours(info.digest, PAIRS)
    np.testing.assert_allclose(got[:, 0], want, atol=1e-4, rtol=0)
    assert np.ptp(want) > 1e-3          # the tiny model does tell pairs apart
    toks = ce.tokenizer([q for q, _ in PAIRS], [d for _, d in PAIRS], truncation=True, max_length=128)
    assert [e[0] for e in enc] == toks["input_ids"]


@pytest.mark.parametrize("multi_label", [False, True])
def test_classifier_probabilities_and_labels_match_transformers(tmp_path: Path, bi_home: Path,
                                                                multi_label: bool) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    src = make_tiny_classifier(tmp_path / "cls", num_labels=4, multi_label=multi_label, seed=5)
    info = import_bundle(src, "cls", alias="prod")
    assert info.task == "classify"
    model = AutoModelForSequenceClassification.from_pretrained(src).eval()
    tok = AutoTokenizer.from_pretrained(src)
    batch = tok(TEXTS, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    want = (torch.sigmoid(logits) if multi_label else torch.softmax(logits, -1)).numpy()
    got, _ = _ours(info.digest, TEXTS)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    labels = open_runtime(info.digest).meta["labels"]
    assert labels == [model.config.id2label[i] for i in range(4)]
    assert [labels[i] for i in got.argmax(1)] == [model.config.id2label[int(i)] for i in want.argmax(1)]
    assert open_runtime(info.digest).meta["activation"] == ("sigmoid" if multi_label else "softmax")
