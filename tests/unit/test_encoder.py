"""The BERT encoder runtime and its tokenizer on tiny random models, without a reference
implementation (their parity with transformers is in tests/parity/test_encoder_parity.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from batchinf.errors import BundleError
from batchinf.runtime.encoder import (
    EncoderConfig,
    embed_batch,
    load_encoder,
    read_pooling_config,
    sentence_transformers_max_length,
)
from batchinf.runtime.st_modules import head, pool
from batchinf.runtime.tokenizer import TextTokenizer
from tests.helpers.tiny_models import ENCODER_TEXTS as TEXTS
from tests.helpers.tiny_models import make_tiny_bert, with_fixed_padding


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny"))


def test_pool_matches_manual_reference() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    means = torch.stack([hidden[i, : int(mask[i].sum())].mean(0) for i in range(3)])
    torch.testing.assert_close(pool(hidden, mask, "mean"), means)
    torch.testing.assert_close(head(pool(hidden, mask, "mean"), [], normalize=True), means / means.norm(dim=1, keepdim=True))
    torch.testing.assert_close(pool(hidden, mask, "cls"), hidden[:, 0])
    cls = head(pool(hidden, mask, "cls"), [], normalize=True)
    torch.testing.assert_close(cls, F.normalize(hidden[:, 0], dim=1))
    torch.testing.assert_close(cls.norm(dim=1), torch.ones(3))


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_embed_batch_pads_and_pools(tmp_path: Path, pooling: str) -> None:
    d = make_tiny_bert(tmp_path, pooling=pooling, normalize=False)
    assert read_pooling_config(d) == (pooling, False)
    tok = TextTokenizer.from_file(d / "tokenizer.json", 64)
    model = load_encoder(d)
    batch = [e.ids for e in tok.encode_batch(TEXTS)]
    vecs, padded = embed_batch(model, batch, tok.pad_id, pooling, normalize=False)
    assert vecs.shape == (len(TEXTS), 32) and vecs.dtype == "float32"
    assert padded == len(TEXTS) * max(map(len, batch))
    # Padding must not change any row: each text alone gives the same vector.
    for i, ids in enumerate(batch):
        alone, n = embed_batch(model, [ids], tok.pad_id, pooling, normalize=False)
        assert n == len(ids)
        assert abs(alone[0] - vecs[i]).max() <= 1e-5


def test_read_pooling_config_variants(tmp_path: Path) -> None:
    assert read_pooling_config(tmp_path) == ("mean", False)
    assert sentence_transformers_max_length(tmp_path) is None
    d = make_tiny_bert(tmp_path / "m", pooling="cls", normalize=True, max_position=64)
    assert read_pooling_config(d) == ("cls", True)
    assert sentence_transformers_max_length(d) == 64
    # sentence-transformers >= 6 writes new module paths and a single pooling_mode key.
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
    ]))
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    assert read_pooling_config(d) == ("mean", False)
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": ["max", "cls"]}))
    assert read_pooling_config(d) == (["max", "cls"], False)
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "median"}))
    with pytest.raises(BundleError, match="median"):
        read_pooling_config(d)


def test_tokenizer_max_length_overrides_tokenizer_json(tiny: Path, tmp_path: Path) -> None:
    path = with_fixed_padding(tiny, tmp_path / "tokenizer.json")
    text = "the man made a good picture of the world and each house"  # 12 words, all in vocab
    n = len(text.split()) + 2
    ours = TextTokenizer.from_file(path, max_length=32)
    assert ours.pad_id == 0
    enc = ours.encode(text)
    assert len(enc.ids) == n and not enc.truncated
    assert enc.ids[0] == 2 and enc.ids[-1] == 3  # [CLS] ... [SEP], no [PAD]
    assert [len(e.ids) for e in ours.encode_batch(["hello", text])] == [3, n]  # no batch padding

    for max_length in (32, n, n - 1, 5, 3):
        small = TextTokenizer.from_file(path, max_length=max_length)
        got = small.encode(text)
        assert len(got.ids) == min(n, max_length)
        assert got.truncated == (n > max_length)
        assert got.ids[-1] == 3  # [SEP] kept when truncating
        batch = small.encode_batch([text, "hello", text])
        assert [e.truncated for e in batch] == [n > max_length, False, n > max_length]


def test_tokenizer_pad_id_fallbacks(tiny: Path, tmp_path: Path) -> None:
    tj = json.loads((tiny / "tokenizer.json").read_text())
    assert tj["padding"] is None
    assert TextTokenizer.from_file(tiny / "tokenizer.json", 16).pad_id == 0  # from the [PAD] token
    tj["padding"] = {
        "strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
        "pad_id": 7, "pad_type_id": 0, "pad_token": "[PAD]",
    }
    (tmp_path / "t.json").write_text(json.dumps(tj))
    tok = TextTokenizer.from_file(tmp_path / "t.json", 16)
    assert tok.pad_id == 7
    assert len(tok.encode_batch(["hello", "hello world the"])[0].ids) == 3  # padding disabled


def test_load_encoder_refuses_missing_weight(tiny: Path, tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((tiny / name).read_bytes())
    weights = load_file(tiny / "model.safetensors")
    del weights["encoder.layer.1.attention.self.key.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(BundleError, match=r"encoder\.layer\.1\.attention\.self\.key\.weight"):
        load_encoder(tmp_path)


def test_load_encoder_accepts_bert_prefix_and_shards(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes((tiny / "config.json").read_bytes())
    weights = {"bert." + k: v for k, v in load_file(tiny / "model.safetensors").items()}
    keys = sorted(weights)
    save_file({k: weights[k] for k in keys[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: weights[k] for k in keys[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    a, b = load_encoder(tiny), load_encoder(tmp_path)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_load_encoder_refuses_pickle_only_dir(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes((tiny / "config.json").read_bytes())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(BundleError, match="safetensors"):
        load_encoder(tmp_path)


def test_config_rejects_unsupported_activation() -> None:
    base = {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 16, "max_position_embeddings": 16}
    assert EncoderConfig.from_hf(base).hidden_act == "gelu"
    with pytest.raises(BundleError, match="relu"):
        EncoderConfig.from_hf({**base, "hidden_act": "relu"})


def test_embed_batch_refuses_empty_sequences(tiny: Path) -> None:
    from batchinf.errors import BatchinfError

    model = load_encoder(tiny)
    for batch in ([], [[2, 3], []]):
        with pytest.raises(BatchinfError):
            embed_batch(model, batch, 0, "mean", normalize=True)


def test_fused_layer_matches_unfused_reference_and_follows_weight_writes() -> None:
    """The fused QKV projection, bias-in-residual accumulation, in-place GELU and additive mask
    give what three separate projections, dense + residual and a boolean mask give; writing a
    weight in place rebuilds the fused projection."""
    from batchinf.runtime.encoder import BertLayer, attention_bias

    torch.manual_seed(0)
    layer = BertLayer(EncoderConfig(10, 16, 1, 4, 32, 20)).eval()
    x = torch.randn(3, 5, 16)
    am = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] + [0] * 4])

    def reference() -> torch.Tensor:
        a = layer.attention
        q, k, v = (p(x).view(3, 5, 4, 4).transpose(1, 2) for p in (a.self.query, a.self.key, a.self.value))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=am.bool()[:, None, None, :])
        h = a.output.LayerNorm(a.output.dense(y.transpose(1, 2).reshape(3, 5, 16)) + x)
        f = F.gelu(layer.intermediate.dense(h))
        return layer.output.LayerNorm(layer.output.dense(f) + h)

    for _ in range(2):
        with torch.inference_mode():
            got = layer(x, attention_bias(am, torch.float32))
        assert (got - reference()).abs().max() < 1e-5
        with torch.no_grad():
            layer.attention.self.value.weight.mul_(3)   # the second pass must see this


def test_prepacked_layer_matches_the_plain_one_and_follows_weight_writes() -> None:
    """With oneDNN-prepacked projections (GELU and the residual add fused into their GEMMs) a layer
    gives what the plain path gives; a weight written in place makes its packed copy stale, and the
    layer follows the write."""
    import copy

    from batchinf.runtime.encoder import BertLayer, attention_bias, pack_encoder

    torch.manual_seed(0)
    layer = BertLayer(EncoderConfig(10, 16, 1, 4, 32, 20)).eval()
    plain = copy.deepcopy(layer)
    assert pack_encoder(torch.nn.ModuleList([layer]))       # every x86 CPU build of torch has oneDNN
    assert layer.intermediate.packed is not None and plain.intermediate.packed is None
    x = torch.randn(3, 5, 16)
    bias = attention_bias(torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] + [0] * 4]), torch.float32)
    for _ in range(2):
        with torch.inference_mode():
            assert (layer(x, bias) - plain(x, bias)).abs().max() < 1e-5
        with torch.no_grad():                   # the second pass must see these
            for m in (layer, plain):
                m.intermediate.dense.weight.mul_(3)
                m.output.dense.bias.add_(1)
                m.attention.self.key.weight.mul_(2)
    assert not layer.intermediate.packed.fresh(layer.intermediate.dense.weight, layer.intermediate.dense.bias)
