"""The BERT encoder runtime and its tokenizer against transformers (the reference implementation),
on tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchinf.runtime.encoder import load_encoder
from batchinf.runtime.tokenizer import TextTokenizer
from tests.helpers.tiny_models import ENCODER_TEXTS as TEXTS
from tests.helpers.tiny_models import make_tiny_bert, with_fixed_padding

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny"))


def _padded(tok: TextTokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [e.ids for e in tok.encode_batch(texts)]
    S = max(map(len, ids))
    input_ids = torch.tensor([x + [tok.pad_id] * (S - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (S - len(x)) for x in ids])
    return input_ids, mask


def test_hidden_states_match_transformers(tiny: Path) -> None:
    from transformers import BertModel

    tok = TextTokenizer.from_file(tiny / "tokenizer.json", max_length=64)
    input_ids, mask = _padded(tok, TEXTS)
    assert (mask == 0).any(), "batch must contain padding"

    ref = BertModel.from_pretrained(str(tiny), attn_implementation="eager", torch_dtype=torch.float32).eval()
    ours = load_encoder(tiny)
    with torch.inference_mode():
        expected = ref(input_ids=input_ids, attention_mask=mask).last_hidden_state
        got = ours(input_ids, mask)
    assert got.shape == expected.shape
    real = mask.bool()
    assert (got[real] - expected[real]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("act", ["gelu_new", "gelu_pytorch_tanh"])
def test_tanh_gelu_matches_transformers(tmp_path: Path, act: str) -> None:
    from transformers import BertModel

    d = make_tiny_bert(tmp_path, seed=3)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_act": act}))
    input_ids, mask = _padded(TextTokenizer.from_file(d / "tokenizer.json", 64), TEXTS)
    ref = BertModel.from_pretrained(str(d), attn_implementation="eager").eval()
    with torch.inference_mode():
        expected = ref(input_ids=input_ids, attention_mask=mask).last_hidden_state
        got = load_encoder(d)(input_ids, mask)
    assert (got[mask.bool()] - expected[mask.bool()]).abs().max().item() <= 1e-4


def test_truncation_matches_transformers_fast_tokenizer(tiny: Path, tmp_path: Path) -> None:
    """tokenizer.json's own truncation and padding overridden by max_length, as transformers does."""
    from transformers import PreTrainedTokenizerFast

    path = with_fixed_padding(tiny, tmp_path / "tokenizer.json")
    text = "the man made a good picture of the world and each house"  # 12 words, all in vocab
    n = len(text.split()) + 2
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
    for max_length in (32, n, n - 1, 5, 3):
        small = TextTokenizer.from_file(path, max_length=max_length)
        got = small.encode(text)
        want = hf(text, truncation=True, max_length=max_length)["input_ids"]
        assert got.ids == want
        batch = small.encode_batch([text, "hello", text])
        assert [e.ids for e in batch] == hf([text, "hello", text], truncation=True, max_length=max_length)["input_ids"]
