"""GGUF import of Qwen3, Gemma 2 and Gemma 3 (text): tiny random models built by transformers,
and tiny Llama (Llama 3 rope scaling) and Mistral ones, converted by llama.cpp's own
convert_hf_to_gguf.py (f32, f16 and q8_0), imported with our converter, and
run on our decoder. The logits equal transformers' on the original HF model within 1e-4 (f32; f16
files are compared with the HF model's f16-rounded weights), greedy tokens are identical, and the
imported weights equal what transformers' own GGUF loader reads from the same file."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from batchinf.runtime import bundle as rb
from batchinf.runtime.decoder_config import rope_inv_freq
from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.gguf import convert_gguf
from batchinf.runtime.llama import load_llama
from tests.helpers.decoder_parity import assert_greedy_matches, hf_causal_lm, prefill_logits
from tests.helpers.hf_to_gguf import hf_to_gguf
from tests.helpers.tiny_decoders import WINDOW, make_tiny_decoder
from tests.helpers.tiny_llama import make_tiny_llama

pytestmark = pytest.mark.parity

# What a GGUF file can say: llama.cpp stores no query_pre_attn_scalar (it uses head_dim) and no Gemma 3
# layer pattern (every sixth layer global); Qwen3's head_dim differs from hidden / heads, as in the real ones.
# Llama (Llama 3 rope scaling: llama.cpp writes a rope_freqs tensor) and Mistral (written as `llama`,
# Q/K rows permuted) come from tiny_llama.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": dict(layers=3, head_dim=32),
    "gemma2": dict(layers=3, query_pre_attn_scalar=16),
    "gemma3_text": dict(layers=6, query_pre_attn_scalar=16, layer_types=None),
    "llama": {}, "mistral": {},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, Path]]:
    """family -> (HF dir, GGUF file (f32), our import of it)."""
    root = tmp_path_factory.mktemp("gguf-families")
    out = {}
    for i, (fam, spec) in enumerate(FAMILIES.items()):
        hf = (make_tiny_llama(root / fam, family=fam, seed=10 + i) if fam in ("llama", "mistral")
              else make_tiny_decoder(root / fam, fam, seed=10 + i, **spec))
        gguf = hf_to_gguf(hf, "f32")
        out[fam] = (hf, gguf, convert_gguf(gguf, root / f"{fam}-imported"))
    return out


def _seqs(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 3 * WINDOW + 3, 2 * WINDOW, 1)]


def _assert_logits(ours, ref, seqs: list[list[int]], tol: float, label: str) -> None:
    got = prefill_logits(ours, seqs)
    for i, s in enumerate(seqs):
        with torch.inference_mode():
            want = ref(torch.tensor([s])).logits[0]
        assert (got[i, :len(s)] - want).abs().max().item() <= tol, (label, i)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_imported_config_is_the_original(models, family: str) -> None:
    hf, gguf, ours = models[family]
    want, got = load_llama(hf).config, load_llama(ours).config
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)      # stored as float32
    imported_type = "llama" if family == "mistral" else family      # Mistral files are `llama` ones
    assert got.model_type == imported_type
    # Llama 3 rope parameters come back from rope_freqs as another split giving the same frequencies
    torch.testing.assert_close(rope_inv_freq(got), rope_inv_freq(want), rtol=1e-6, atol=0)
    assert dataclasses.replace(got, rms_norm_eps=want.rms_norm_eps, model_type=family,
                               rope_scaling=want.rope_scaling) == want, family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_logits_and_greedy_match_transformers_on_the_hf_model(models, family: str) -> None:
    hf, gguf, ours = models[family]
    ref = hf_causal_lm(hf)
    _assert_logits(load_llama(ours), ref, _seqs(ref.config.vocab_size), 1e-4, family)
    assert_greedy_matches(ours, _seqs(ref.config.vocab_size)[:3], 16, family, ref=ref)


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_weights_match_transformers_gguf_loader(models, family: str, outtype: str, tmp_path: Path) -> None:
    """transformers' GGUF loader on the same file: the same tensors (Gemma's +1 undone alike). Its loader
    ignores `qwen3.attention.key_length` (head_dim falls back to 128), so Qwen3's attention tensors get
    other shapes there and only the rest is compared."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf, gguf, ours = models[family]
    if outtype != "f32":
        gguf = hf_to_gguf(hf, outtype)
        ours = convert_gguf(gguf, tmp_path / outtype)
    theirs = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                  ignore_mismatched_sizes=family == "qwen3").state_dict()
    mine = load_file(str(ours / "model.safetensors"))
    assert set(mine) <= set(theirs)
    compared = [name for name, w in mine.items() if w.shape == theirs[name].shape]
    assert family == "qwen3" or len(compared) == len(mine)
    assert any("norm" in n for n in compared) and any("mlp" in n for n in compared)
    for name in compared:
        assert torch.equal(mine[name], theirs[name]), (family, name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_f16_gguf_matches_the_f16_rounded_model(models, family: str, tmp_path: Path) -> None:
    """llama.cpp's f16 output (norms stay f32): the imported matrices are the HF ones rounded to f16."""
    from safetensors.torch import load_file

    hf, _, _ = models[family]
    ours = convert_gguf(hf_to_gguf(hf, "f16"), tmp_path / "f16")
    original = load_file(str(hf / "model.safetensors"))
    for name, w in load_file(str(ours / "model.safetensors")).items():
        want = original[name]
        assert torch.equal(w, want.half().float()) or torch.allclose(w, want, atol=1e-6), (family, name)
    ref = hf_causal_lm(hf)
    ref.load_state_dict({k: v for k, v in load_file(str(ours / "model.safetensors")).items()}, strict=False)
    _assert_logits(load_llama(ours), ref, _seqs(ref.config.vocab_size), 1e-4, f"{family} f16")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_imported_bundle_pins_fixtures(models, family: str) -> None:
    meta = rb.build_meta(models[family][2])
    assert meta["task"] == "generate"
    rt = GenerateRuntime(models[family][2], meta)
    rt.load_model()
    rb.verify_generate_fixtures(rt)


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_imported_tokenizer_and_chat_template_match_the_original(models, family: str) -> None:
    """The tiny tokenizer is byte-level BPE with GPT-2's split, which is what the driver names it."""
    hf, _, ours = models[family]
    want, got = GenerateRuntime(hf, {"context_length": 256}), GenerateRuntime(ours, {"context_length": 256})
    for text in ["the people of the world", "  hello\n\tworld 42!", "été ☃", ""]:
        assert got.encode_prompt(text) == want.encode_prompt(text), text
        chat = [{"role": "user", "content": text}]
        assert got.encode_chat(chat) == want.encode_chat(chat), text
