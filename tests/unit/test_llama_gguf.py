"""Our GGUF helpers that need no reference implementation: llama.cpp's Q/K permutation undone,
and the tokenizer built from GGUF metadata (the reader itself against the `gguf` package is in
tests/parity/test_gguf_parity.py)."""

from __future__ import annotations

import numpy as np
import pytest

from batchinf.errors import BundleError
from batchinf.runtime.gguf import build_tokenizer, unpermute


def test_unpermute_inverts_llama_cpp_permute() -> None:
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:    # convert_hf_to_gguf.py's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    assert not np.array_equal(permute(w, 3), w)
    np.testing.assert_array_equal(unpermute(permute(w, 3), 3), w)


def test_tokenizer_from_vocabulary_and_merges() -> None:
    tokens = ["<|endoftext|>", "h", "e", "l", "o", "Ġ", "w", "r", "d", "1", "2", "he", "ll", "hell", "hello", "Ġw",
              "12"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
            "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "Ġ w", "1 2"]}
    tok = build_tokenizer(meta)
    assert tok.encode("hello<|endoftext|>12").ids == [14, 0, 9, 10]     # digits split: "12" is never merged
    assert tok.decode(tok.encode("hello world").ids) == "hello world"
    with pytest.raises(BundleError, match="tokenizer.ggml.pre 'mystery'"):
        build_tokenizer({**meta, "tokenizer.ggml.pre": "mystery"})
