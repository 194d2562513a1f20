"""Projections kept 4-bit (runtime/block_weights.py): Q4_1 blocks recovered bit for bit from the
float32 weights a Q4_1 GGUF import stores, expanded by the C kernel into the same float32 values,
so a decoder's logits and greedy tokens are identical with BATCHINF_BLOCK_WEIGHTS on and off."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from batchinf.config import settings
from batchinf.runtime import block_weights, gguf_quants
from batchinf.runtime.llama import KVCache, load_llama
from batchinf.runtime.block_weights import BlockEmbedding, BlockLinear, q4_1_blocks, q8_0_blocks
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


def ggml_q8_0(w: np.ndarray) -> np.ndarray:
    """llama.cpp's Q8_0 quantiser (quantize_row_q8_0_ref) -> the GGUF blocks' bytes [blocks, 34]."""
    b = w.astype(np.float32).reshape(-1, 32)
    d = np.abs(b).max(1) / 127
    inv = np.where(d != 0, 1 / np.where(d == 0, 1, d), 0).astype(np.float32)
    q = np.rint(b * inv[:, None]).astype(np.int8)
    out = np.zeros((b.shape[0], 34), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out


def q8_0_rounded(w: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(gguf_quants.q8_0(ggml_q8_0(w.numpy())).reshape(w.shape).copy())


def q4_1_rounded(w: torch.Tensor) -> torch.Tensor:
    """What a Q4_1 GGUF import stores for `w`: its blocks quantised by llama.cpp, dequantised by ours."""
    return torch.from_numpy(gguf_quants.q4_1(ggml_q4_1(w.numpy())).reshape(w.shape).copy())


@pytest.fixture
def q4_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setenv("BATCHINF_HOME", str(tmp_path / "home"))
    settings.cache_clear()
    block_weights.kernel.cache_clear()
    yield
    monkeypatch.undo()
    settings.cache_clear()
    block_weights.kernel.cache_clear()


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
    lin = BlockLinear("q4_1", blocks, 96, 160, None)
    assert torch.equal(lin.weight_float32(), stored)          # bit for bit, not approximately
    x = torch.randn(7, 160, generator=gen)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, stored))
    torch.set_num_threads(2)                                  # the expansion split across threads
    try:
        big = q4_1_rounded(torch.randn(512, 512, generator=gen))
        assert torch.equal(BlockLinear("q4_1", q4_1_blocks(big.numpy()), 512, 512, None).weight_float32(), big)
    finally:
        torch.set_num_threads(1)


def test_q8_0_blocks_are_recovered_exactly_and_rows_are_looked_up_alike(q4_home: None) -> None:
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(80, 96, generator=gen) * 0.2
    w[5, :32] = 0                                             # a block of zeros
    raw = ggml_q8_0(w.numpy())
    stored = q8_0_rounded(w)
    blocks = q8_0_blocks(stored.numpy())
    assert blocks is not None and q4_1_blocks(stored.numpy()) is None
    assert np.array_equal(blocks[0].view(np.uint8), raw[:, 2:])
    assert np.array_equal(blocks[1], raw[:, 0:2].copy().view(np.float16).astype(np.float32).ravel())
    lin = BlockLinear("q8_0", blocks, 80, 96, None)
    assert torch.equal(lin.weight_float32(), stored)
    ids = torch.tensor([[3, 5, 79], [0, 0, 41]])
    assert torch.equal(BlockEmbedding(lin)(ids), stored[ids])
    q4 = q4_1_rounded(w)
    assert torch.equal(BlockLinear("q4_1", q4_1_blocks(q4.numpy()), 80, 96, None).rows(ids), q4[ids])
    off = stored.clone()
    off[7, 40] = torch.nextafter(off[7, 40], torch.tensor(9.0))
    assert q8_0_blocks(off.numpy()) is None


def test_weights_that_are_not_q4_1_blocks_stay_float32() -> None:
    w = torch.randn(8, 64)
    assert q4_1_blocks(w.numpy()) is None                     # arbitrary floats
    stored = q4_1_rounded(w)
    stored[3, 5] = torch.nextafter(stored[3, 5], torch.tensor(1.0))   # one value off by an ulp
    assert q4_1_blocks(stored.numpy()) is None
    assert q4_1_blocks(torch.randn(8, 48).numpy()) is None   # rows not a whole number of blocks


def _q4_model_dir(tmp_path: Path, embedding: str | None = None) -> Path:
    """A tiny decoder whose projections are Q4_1-rounded (as a Q4_1 GGUF import stores them); its
    embedding, tied to the vocabulary projection, stays float32 or is rounded as `embedding`
    (q8_0, as SmolLM2's Q4_1 GGUF holds it)."""
    d = make_tiny_llama(tmp_path / "m", family="llama", seed=3)
    state = load_file(str(d / "model.safetensors"))
    assert "lm_head.weight" not in state, "a tied model"
    for k, v in state.items():
        if k.endswith("_proj.weight"):
            state[k] = q4_1_rounded(v)
        if k == "model.embed_tokens.weight" and embedding is not None:
            state[k] = {"q8_0": q8_0_rounded, "q4_1": q4_1_rounded}[embedding](v)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    cache = KVCache(model.config, tokens.shape[0], 32, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        first = model.prefill(tokens, torch.full((tokens.shape[0],), tokens.shape[1]), torch.arange(tokens.shape[0]),
                              cache)
        step = model.decode_step(first.argmax(-1), torch.full((tokens.shape[0],), tokens.shape[1]), cache)
    return [first, step]


@pytest.mark.parametrize("embedding", [None, "q8_0"])
def test_a_decoder_with_block_weights_gives_identical_logits(tmp_path: Path, q4_home: None, embedding: str | None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    d = _q4_model_dir(tmp_path, embedding)
    monkeypatch.setenv("BATCHINF_BLOCK_WEIGHTS", "0")
    settings.cache_clear()
    plain = load_llama(d)
    assert not any(isinstance(m, BlockLinear) for m in plain.modules())
    monkeypatch.delenv("BATCHINF_BLOCK_WEIGHTS")              # on by default
    settings.cache_clear()
    small = load_llama(d)
    kept = [m for m in small.modules() if isinstance(m, BlockLinear)]
    cfg = small.config
    assert sum(m.fmt == "q4_1" for m in kept) == 7 * cfg.num_hidden_layers   # q, k, v, o, gate, up, down: every layer's
    if embedding is None:
        assert not isinstance(small.lm_head, BlockLinear)
    else:           # the tied table is held once, as blocks, for both its uses
        assert isinstance(small.lm_head, BlockLinear) and small.lm_head.fmt == embedding
        assert small.model.embed_tokens.table is small.lm_head
    tokens = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    for a, b in zip(_logits(plain, tokens), _logits(small, tokens)):
        assert torch.equal(a, b)
    held = sum(b.numel() * b.element_size() for m in kept for b in m.buffers())
    assert held * 3 < sum(m.out_features * m.in_features * 4 for m in kept)     # 0.75 and 1.125 bytes a weight
    assert list((tmp_path / "home" / "cache" / "kernels").glob("blocks-*.so")), "the kernel is built once, kept"


def test_without_a_c_compiler_the_weights_stay_float32(tmp_path: Path, q4_home: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    d = _q4_model_dir(tmp_path)
    monkeypatch.setenv("BATCHINF_BLOCK_WEIGHTS", "1")
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    settings.cache_clear()
    model = load_llama(d)
    assert not any(isinstance(m, BlockLinear) for m in model.modules())
    tokens = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    assert torch.isfinite(_logits(model, tokens)[1]).all()


def test_only_pages_of_a_file_map_are_handed_back(tmp_path: Path) -> None:
    """A swapped weight's float32 pages go back to the kernel only where they are the bundle file's
    (read again from it if touched); anonymous memory would read back as zeros, so it is kept."""
    from batchinf.runtime.weights import load_safetensors

    save_file({"w": torch.arange(4096 * 4, dtype=torch.float32).reshape(4, 4096)}, str(tmp_path / "w.safetensors"))
    mapped = load_safetensors(tmp_path / "w.safetensors")["w"]
    block_weights._hand_back(mapped)
    assert torch.equal(mapped, torch.arange(4096 * 4, dtype=torch.float32).reshape(4, 4096))   # read again
    ptr, size = mapped.data_ptr(), mapped.numel() * 4
    assert block_weights._in_file_map(ptr, ptr + size)
    anon = torch.ones(4, 4096)
    block_weights._hand_back(anon)
    assert bool((anon == 1).all())
    assert not block_weights._in_file_map(anon.data_ptr(), anon.data_ptr() + anon.numel() * 4)


def test_a_large_weight_is_multiplied_a_slice_of_rows_at_a_time(q4_home: None, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(5)
    stored = q8_0_rounded(torch.randn(100, 64, generator=gen))
    monkeypatch.setattr(block_weights, "SCRATCH_WEIGHTS", 64 * 7)       # slices of 7 rows, the last one of 2
    lin = BlockLinear("q8_0", q8_0_blocks(stored.numpy()), 100, 64, torch.arange(100, dtype=torch.float32))
    x = torch.randn(3, 5, 64, generator=gen)
    block_weights._local.buf = None                                    # this thread's scratch, from nothing
    want = torch.nn.functional.linear(x, stored, torch.arange(100, dtype=torch.float32))
    assert torch.allclose(lin(x), want, rtol=0, atol=1e-5)
    assert block_weights._local.buf.numel() < stored.numel()           # the scratch held a slice, not the weight
    assert torch.equal(lin.weight_float32(93, 7), stored[93:])
