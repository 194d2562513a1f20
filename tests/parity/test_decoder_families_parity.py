"""Qwen3, Gemma 2 and Gemma 3 (text) on the shared decoder against transformers, on tiny random
models that transformers itself built: logits over a right-padded batch, including sequences far
past Gemma's sliding window (so the windowed layers, soft-capping and Gemma 3's per-layer rope
bases all count), and greedy generation through continuous batching."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from batchinf.runtime import bundle as rb
from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.llama import load_llama
from tests.helpers.decoder_parity import assert_greedy_matches, hf_causal_lm, prefill_logits
from tests.helpers.tiny_decoders import CONFIGS, WINDOW, make_tiny_decoder

pytestmark = pytest.mark.parity

TEXTS = ["the people of the world", "hello",
         "write a long sentence about water and the earth, then stop, and then write one more about the sky",
         "number 42 is the answer to: what"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-decoders")
    return {fam: make_tiny_decoder(root / fam, fam, seed=i) for i, fam in enumerate(CONFIGS)}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_logits_match_transformers(dirs: dict[str, Path], family: str) -> None:
    d = dirs[family]
    ours, ref = load_llama(d), hf_causal_lm(d)
    rt = GenerateRuntime(d, {"context_length": 256})
    seqs = [rt.encode_prompt(t) for t in TEXTS]
    assert max(map(len, seqs)) > 2 * WINDOW
    got = prefill_logits(ours, seqs)
    for i, s in enumerate(seqs):
        with torch.inference_mode():
            want = ref(torch.tensor([s])).logits[0]
        assert (got[i, :len(s)] - want).abs().max().item() <= 1e-4, (family, i)
    if family.startswith("gemma"):
        cfg = ours.config
        assert cfg.local_window == WINDOW and "sliding_attention" in cfg.layer_types
        assert (family == "gemma2") == (cfg.final_softcap is not None and cfg.attn_softcap is not None)
        assert got.abs().max() <= (cfg.final_softcap or float("inf"))
        # the window is real: without it, tokens past the window get other logits
        ours.config = dataclasses.replace(cfg, local_window=None)
        ours.windowed = False
        unwindowed = prefill_logits(ours, seqs)
        long = max(range(len(seqs)), key=lambda i: len(seqs[i]))
        assert torch.allclose(unwindowed[long, :WINDOW], got[long, :WINDOW], atol=1e-5)
        assert (unwindowed[long, WINDOW:len(seqs[long])] - got[long, WINDOW:len(seqs[long])]).abs().max() > 1e-3


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_matches_transformers(dirs: dict[str, Path], family: str) -> None:
    assert_greedy_matches(dirs[family], TEXTS, 24, family)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_bundle_import_pins_fixtures(dirs: dict[str, Path], family: str) -> None:
    meta = rb.build_meta(dirs[family])
    assert meta["task"] == "generate" and meta["model_type"] == family
    rt = GenerateRuntime(dirs[family], meta)
    rt.load_model()
    rb.verify_generate_fixtures(rt)
