"""GGUF architecture table: layer patterns as llama.cpp's set_swa_pattern, Gemma's norm offset,
tensor names per architecture, and the refusal of an unknown architecture."""

from __future__ import annotations

import pytest

from batchinf.errors import BundleError
from batchinf.runtime.gguf_arch import ARCHS, arch_of, hf_tensor_name, layer_names, layer_types, norm_shift


def test_layer_patterns_follow_llama_cpp() -> None:
    s, f = "sliding_attention", "full_attention"
    assert layer_types(2, 4) == [s, f, s, f]                       # Gemma 2
    assert layer_types(6, 7) == [s] * 5 + [f, s]                   # Gemma 3
    assert layer_types([True, False, True], 3) == [s, f, s]
    with pytest.raises(BundleError, match="lists 2 layers"):
        layer_types([True, False], 3)
    with pytest.raises(BundleError, match="at least 1"):
        layer_types(0, 3)


def test_names_and_norm_offset_per_architecture() -> None:
    gemma, llama, qwen3 = ARCHS["gemma3"], ARCHS["llama"], ARCHS["qwen3"]
    assert hf_tensor_name(gemma, "blk.2.ffn_norm.weight", layer_names(gemma)) == \
        "model.layers.2.pre_feedforward_layernorm.weight"
    assert hf_tensor_name(llama, "blk.2.ffn_norm.weight", layer_names(llama)) == \
        "model.layers.2.post_attention_layernorm.weight"
    assert hf_tensor_name(qwen3, "blk.0.attn_q_norm.weight", layer_names(qwen3)) == \
        "model.layers.0.self_attn.q_norm.weight"
    assert hf_tensor_name(llama, "blk.0.attn_q_norm.weight", layer_names(llama)) is None
    assert hf_tensor_name(llama, "blk.x.attn_q.weight", layer_names(llama)) is None
    assert norm_shift(gemma, "blk.0.attn_k_norm.weight") == -1.0 and norm_shift(gemma, "blk.0.attn_q.weight") == 0.0
    assert norm_shift(qwen3, "output_norm.weight") == 0.0


def test_unknown_architecture_is_refused() -> None:
    with pytest.raises(BundleError, match="'phi3' is not supported.*gemma3"):
        arch_of({"general.architecture": "phi3"}, "m.gguf")
