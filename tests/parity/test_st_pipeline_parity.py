"""sentence-transformers directories against sentence-transformers' own `encode`: every Pooling
mode (and a concatenation), Dense, Normalize and prompts over BERT; XLM-RoBERTa (positions offset
by padding_idx + 1); ModernBERT (native: local/global attention and rope bases); a Qwen3 decoder
with last-token pooling (Qwen3-Embedding's layout); a bidirectional Gemma 3 (EmbeddingGemma's layout)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from batchinf.errors import BundleError
from batchinf.runtime import bundle as rb
from batchinf.runtime.embed import EmbedRuntime
from batchinf.runtime.st_modules import POOLING_MODES
from batchinf.tasks import build_meta
from batchinf.tasks.embed_request import prompt_for
from tests.helpers.tiny_decoders import WINDOW
from tests.helpers.tiny_models import ENCODER_TEXTS
from tests.helpers.tiny_st import (PROMPTS, make_st_bert, make_st_embeddinggemma, make_st_modernbert, make_st_qwen3,
                                  make_st_xlmr)

pytestmark = pytest.mark.parity


def _ours(d: Path, texts: list[str], prompt_name: str | None = None) -> tuple[dict, np.ndarray]:
    meta = build_meta(d)
    rt = EmbedRuntime(d, meta)
    prefix = prompt_for(meta, prompt_name, None)
    ids = [e.ids for e in rt.tokenizer.encode_batch([prefix + t for t in texts])]
    rb.verify_model_fixtures(rt)
    return meta, rt.embed(ids)[0]


def _reference(d: Path, texts: list[str], prompt_name: str | None = None) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(d), device="cpu")
    return model.encode(texts, prompt_name=prompt_name, batch_size=3, convert_to_numpy=True)


@pytest.mark.parametrize("modes", [[m] for m in POOLING_MODES] + [["cls", "mean", "max"]])
def test_bert_pooling_dense_normalize_prompts(tmp_path: Path, modes: list[str]) -> None:
    d = make_st_bert(tmp_path / "st", modes, dense_out=24, prompts=PROMPTS)
    meta, got = _ours(d, ENCODER_TEXTS, "query")
    want = _reference(d, ENCODER_TEXTS, "query")
    assert got.shape == want.shape == (len(ENCODER_TEXTS), 24)
    assert np.abs(got - want).max() <= 1e-5, modes
    assert meta["prompts"] == PROMPTS and meta["normalize"] and meta["dense"][0]["out_features"] == 24
    assert [fx.get("prompt_name") for fx in meta["fixtures"]][-2:] == ["passage", "query"]
    # the prompt changes the vectors: it is part of what a job computes
    assert np.abs(got - _ours(d, ENCODER_TEXTS)[1]).max() > 1e-3


def test_xlm_roberta_positions_offset_by_padding_idx(tmp_path: Path) -> None:
    d = make_st_xlmr(tmp_path / "xlmr")
    texts = [t.lower() for t in ENCODER_TEXTS]
    meta, got = _ours(d, texts, "passage")
    assert meta["family"] == "xlm-roberta" and meta["max_length"] == 62
    assert np.abs(got - _reference(d, texts, "passage")).max() <= 1e-5


def test_modernbert_native(tmp_path: Path) -> None:
    d = make_st_modernbert(tmp_path / "modernbert")
    meta, got = _ours(d, ENCODER_TEXTS, "query")
    assert meta["family"] == "modernbert" and "encoder" not in meta     # native, not the fallback
    assert max(len(fx["token_ids"]) for fx in meta["fixtures"]) > 8      # past the local window
    assert np.abs(got - _reference(d, ENCODER_TEXTS, "query")).max() <= 1e-5


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_decoder_embedding(tmp_path: Path, pooling: str) -> None:
    d = make_st_qwen3(tmp_path / "qwen3-embed", pooling)
    meta, got = _ours(d, ENCODER_TEXTS, "query")
    assert meta["task"] == "embed" and meta["encoder"] == "decoder" and meta["pooling"] == pooling
    assert np.abs(got - _reference(d, ENCODER_TEXTS, "query")).max() <= 1e-5


def test_embeddinggemma_bidirectional(tmp_path: Path) -> None:
    d = make_st_embeddinggemma(tmp_path / "embeddinggemma")
    meta, got = _ours(d, ENCODER_TEXTS, "query")
    assert meta["family"] == "gemma3_text" and meta["encoder"] == "decoder" and meta["pooling"] == "mean"
    assert max(len(fx["token_ids"]) for fx in meta["fixtures"]) > 2 * WINDOW     # past the sliding window
    want = _reference(d, ENCODER_TEXTS, "query")
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5
    # bidirectional for real: the causal decoder gives other vectors
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "use_bidirectional_attention": False}))
    assert np.abs(_ours(d, ENCODER_TEXTS, "query")[1] - want).max() > 1e-3
    # it is an encoder: without modules.json it is refused as a generation model
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "modules.json").unlink()
    with pytest.raises(BundleError, match="use_bidirectional_attention"):
        build_meta(d)


def test_refusals(tmp_path: Path) -> None:
    d = make_st_bert(tmp_path / "st", ["mean"], dense_out=8)
    shutil.move(d / "2_Dense" / "model.safetensors", d / "2_Dense" / "pytorch_model.bin")
    with pytest.raises(BundleError, match="pickle"):
        build_meta(d)
    d = make_st_bert(tmp_path / "st2", ["mean"])
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "median"}))
    with pytest.raises(BundleError, match="median"):
        build_meta(d)
    with pytest.raises(Exception, match="not a prompt"):
        prompt_for({"prompts": PROMPTS}, "document", None)
    assert prompt_for({"prompts": PROMPTS}, "query", "verbatim: ") == "verbatim: "
