"""Projections kept 4-bit (runtime/q4_linear.py): Q4_1 blocks recovered bit for bit from the
float32 weights a Q4_1 GGUF import stores, expanded by the C kernel into the same float32 values,
so a decoder's logits and greedy tokens are identical with BATCHINF_Q4_WEIGHTS on and off."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from batchinf.config import settings
from batchinf.runtime import gguf_quants, q4_linear
from batchinf.runtime.llama import KVCache, load_llama
from batchinf.runtime.q4_linear import Q4Linear, q4_1_blocks
from tests.helpers.tiny_llama import make_tiny_llama


def ggml_q4_1(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_1 quantiser (quantize_row_q4_1_ref) -> the GGUF blocks' bytes [blocks, 20]."""
    b = w.astype(np.float32).reshape(-1, 32)
    lo, hi = b.min(1), b.max(1)
    d = (hi - lo) / 15
    inv = np.where(d != 0, 1 / np.where(d == 0, 1, d), 0).astype(np.float32)
    q = np.minimum(15, np.floor((b - lo[:, None]) * inv[:, None] + 0.5)).astype(np.uint8)
    out = np.zeros((b.shape[0], 20), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = lo.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 4:] = q[:, :16] | (q[:, 16:] << 4)
    return out


def q4_1_rounded(w: torch.Tensor) -> torch.Tensor:
    """What a Q4_1 GGUF import stores for `w`: its blocks quantised by llama.cpp, dequantised by ours."""
    return torch.from_numpy(gguf_quants.q4_1(ggml_q4_1(w.numpy())).reshape(w.shape).copy())


@pytest.fixture
def q4_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setenv("BATCHINF_HOME", str(tmp_path / "home"))
    settings.cache_clear()
    q4_linear.kernel.cache_clear()
    yield
    monkeypatch.undo()
    settings.cache_clear()
    q4_linear.kernel.cache_clear()


def test_blocks_are_recovered_exactly_and_expand_to_the_same_floats(q4_home: None) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=gen) * 0.05 + torch.randn(96, 1, generator=gen) * 0.3
    raw = ggml_q4_1(w.numpy())
    stored = q4_1_rounded(w)
    blocks = q4_1_blocks(stored.numpy())
    assert blocks is not None
    nibbles, d, m = blocks
    assert np.array_equal(nibbles, raw[:, 4:])
    assert np.array_equal(d, raw[:, 0:2].copy().view(np.float16).astype(np.float32).ravel())
    assert np.array_equal(m, raw[:, 2:4].copy().view(np.float16).astype(np.float32).ravel())
    lin = Q4Linear(blocks, 96, 160, None)
    assert torch.equal(lin.weight_float32(), stored)          # bit for bit, not approximately
    x = torch.randn(7, 160, generator=gen)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, stored))
    torch.set_num_threads(2)                                  # the expansion split across threads
    try:
        big = q4_1_rounded(torch.randn(512, 512, generator=gen))
        assert torch.equal(Q4Linear(q4_1_blocks(big.numpy()), 512, 512, None).weight_float32(), big)
    finally:
        torch.set_num_threads(1)


def test_weights_that_are_not_q4_1_blocks_stay_float32() -> None:
    w = torch.randn(8, 64)
    assert q4_1_blocks(w.numpy()) is None                     # arbitrary floats
    stored = q4_1_rounded(w)
    stored[3, 5] = torch.nextafter(stored[3, 5], torch.tensor(1.0))   # one value off by an ulp
    assert q4_1_blocks(stored.numpy()) is None
    assert q4_1_blocks(torch.randn(8, 48).numpy()) is None   # rows not a whole number of blocks


def _q4_model_dir(tmp_path: Path) -> Path:
    """A tiny decoder whose projections are Q4_1-rounded (as a Q4_1 GGUF import stores them); its
    embedding and vocabulary projection stay float32."""
    d = make_tiny_llama(tmp_path / "m", family="qwen2", seed=3)
    state = load_file(str(d / "model.safetensors"))
    for k, v in state.items():
        if k.endswith("_proj.weight"):
            state[k] = q4_1_rounded(v)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    cache = KVCache(model.config, tokens.shape[0], 32, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        first = model.prefill(tokens, torch.full((tokens.shape[0],), tokens.shape[1]), torch.arange(tokens.shape[0]),
                              cache)
        step = model.decode_step(first.argmax(-1), torch.full((tokens.shape[0],), tokens.shape[1]), cache)
    return [first, step]


def test_a_decoder_with_q4_weights_gives_identical_logits(tmp_path: Path, q4_home: None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    d = _q4_model_dir(tmp_path)
    plain = load_llama(d)
    monkeypatch.setenv("BATCHINF_Q4_WEIGHTS", "1")
    settings.cache_clear()
    small = load_llama(d)
    q4 = [m for m in small.modules() if isinstance(m, Q4Linear)]
    cfg = small.config
    assert len(q4) == 7 * cfg.num_hidden_layers            # q, k, v, o, gate, up, down: every layer's
    assert not isinstance(small.lm_head, Q4Linear)
    tokens = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    for a, b in zip(_logits(plain, tokens), _logits(small, tokens)):
        assert torch.equal(a, b)
    assert sum(m.nibbles.numel() + 8 * m.d.numel() for m in q4) * 4 < \
        sum(m.weight.numel() * 4 for name, m in plain.named_modules() if name.endswith("_proj"))
    assert list((tmp_path / "home" / "cache" / "kernels").glob("q4_1-*.so")), "the kernel is built once, kept"


def test_without_a_c_compiler_the_weights_stay_float32(tmp_path: Path, q4_home: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    d = _q4_model_dir(tmp_path)
    monkeypatch.setenv("BATCHINF_Q4_WEIGHTS", "1")
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    settings.cache_clear()
    model = load_llama(d)
    assert not any(isinstance(m, Q4Linear) for m in model.modules())
    tokens = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    assert torch.isfinite(_logits(model, tokens)[1]).all()


def test_only_pages_of_a_file_map_are_handed_back(tmp_path: Path) -> None:
    """A swapped weight's float32 pages go back to the kernel only where they are the bundle file's
    (read again from it if touched); anonymous memory would read back as zeros, so it is kept."""
    from batchinf.runtime.weights import load_safetensors

    save_file({"w": torch.arange(4096 * 4, dtype=torch.float32).reshape(4, 4096)}, str(tmp_path / "w.safetensors"))
    mapped = load_safetensors(tmp_path / "w.safetensors")["w"]
    q4_linear._hand_back(mapped)
    assert torch.equal(mapped, torch.arange(4096 * 4, dtype=torch.float32).reshape(4, 4096))   # read again
    ptr, size = mapped.data_ptr(), mapped.numel() * 4
    assert q4_linear._in_file_map(ptr, ptr + size)
    anon = torch.ones(4, 4096)
    q4_linear._hand_back(anon)
    assert bool((anon == 1).all())
    assert not q4_linear._in_file_map(anon.data_ptr(), anon.data_ptr() + anon.numel() * 4)
