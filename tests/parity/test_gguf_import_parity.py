"""GGUF import pieces against transformers: Llama 3 rope parameters recovered from llama.cpp's
`rope_freqs` tensor, and the SentencePiece (`llama`) vocabulary as transformers' GGUF loader builds it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from batchinf.errors import BundleError
from batchinf.runtime.gguf import rope_scaling
from batchinf.runtime.gguf_vocab import build_tokenizer

pytestmark = pytest.mark.parity


def _hf_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=131072, rope_parameters=params)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")[0].double().numpy() if params["rope_type"] != "default" \
        else 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)


@pytest.mark.parametrize("head_dim,theta,factor,low,high,old", [
    (64, 500000.0, 32.0, 1.0, 4.0, 8192),       # Llama 3.2
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),       # Llama 3.1
    (64, 10000.0, 4.0, 2.0, 8.0, 4096),
])
def test_llama3_rope_recovered_from_rope_freqs(head_dim: int, theta: float, factor: float, low: float,
                                               high: float, old: int) -> None:
    want = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": old}
    scaled = _hf_inv_freq(head_dim, theta, want)
    divisors = (_hf_inv_freq(head_dim, theta, None) / scaled).astype(np.float32)   # what llama.cpp stores
    got = rope_scaling({}, "llama", divisors, head_dim, theta)
    assert got is not None and got["rope_type"] == "llama3" and got["factor"] == pytest.approx(factor)
    np.testing.assert_allclose(_hf_inv_freq(head_dim, theta, got), scaled, rtol=2e-6)


def test_rope_metadata_and_refusals() -> None:
    assert rope_scaling({}, "llama", None, 64, 1e4) is None
    assert rope_scaling({}, "llama", np.ones(32, np.float32), 64, 1e4) is None
    assert rope_scaling({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}, "llama", None,
                        64, 1e4) == {"rope_type": "linear", "factor": 2.0}
    yarn = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 32768}
    assert rope_scaling(yarn, "qwen2", None, 64, 1e6) == {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}
    with pytest.raises(BundleError, match="does not follow Llama 3"):
        rope_scaling({}, "llama", np.linspace(3, 1, 32), 64, 1e4)          # decreasing: not llama3's shape
    with pytest.raises(BundleError, match="finite divisors"):
        rope_scaling({}, "llama", np.full(7, np.nan), 64, 1e4)
    with pytest.raises(BundleError, match="longrope"):
        rope_scaling({"llama.rope.scaling.type": "longrope"}, "llama", None, 64, 1e4)


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece vocabulary: unk/bos/eos, the 256 byte tokens, then pieces by score."""
    pieces = ["\u2581", "e", "t", "h", "a", "o", "l", "\u2581t", "he", "\u2581the", "ll", "\u2581h", "\u2581he",
              "llo", "\u2581hello", "wor", "\u2581w", "or", "ld", "\u2581world", "\u2581a", "at", "\u2581cat", "c",
              "w", "r", "d", "\u2581c", "\u00e9", "\u2581\u00e9t\u00e9", "\u00e9t", "\u00e9t\u00e9"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def test_sentencepiece_vocab_matches_transformers_gguf_loader(tmp_path: Path) -> None:
    import gguf
    from transformers import AutoTokenizer

    tokens, scores, types = _spm_vocab()
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True}
    ours = build_tokenizer(meta)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["hello world", "the cat", "  hello", "été at the world", "zebra \u2603 42!\n\tx", ""]:
        want = ref(text)["input_ids"]
        got = ours.encode(text).ids
        assert got == want, text
        assert ours.decode(got, skip_special_tokens=True) == ref.decode(want, skip_special_tokens=True), text


def test_sentencepiece_vocab_of_huge_tokens_is_refused() -> None:
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a" * 10_000] * 600,
            "tokenizer.ggml.scores": [0.0] * 600}
    with pytest.raises(BundleError, match="too long to derive merges"):
        build_tokenizer(meta)
