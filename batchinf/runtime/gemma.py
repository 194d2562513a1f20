"""Gemma 2 and Gemma 3 (text) as flags of the shared decoder (runtime/llama.py): RMSNorm with
(1 + w), embeddings scaled by sqrt(hidden), norms around attention and MLP, query_pre_attn_scalar,
tanh soft-capping of attention scores and logits (Gemma 2), sliding-window attention on the
layers config.json marks `sliding_attention`, q/k norms and a separate rope base for those layers
(Gemma 3), and a gelu-tanh MLP."""

from __future__ import annotations

from typing import Any

from batchinf.errors import BundleError
from batchinf.runtime.decoder_config import ACTIVATIONS, FULL, SLIDING, LlamaConfig, common_fields

GEMMA_TYPES = ("gemma2", "gemma3_text")


def _layer_types(c: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = c.get("layer_types")
    if types is None:   # older config.json: Gemma 2 alternates; Gemma 3 has one global layer per pattern
        pattern = int(c.get("sliding_window_pattern", 2 if c["model_type"] == "gemma2" else 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if len(types) != layers or any(t not in (SLIDING, FULL) for t in types):
        raise BundleError(f"config.json layer_types must list {SLIDING!r} or {FULL!r} for each of {layers} layers")
    return tuple(types)


def gemma_config(c: dict[str, Any]) -> LlamaConfig:
    mt = c.get("model_type")
    if mt not in GEMMA_TYPES:
        raise BundleError(f"model_type {mt!r} is not a Gemma 2/3 text decoder; supported: {', '.join(GEMMA_TYPES)}")
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if ACTIVATIONS.get(act) != "gelu_tanh":
        raise BundleError(f"hidden_activation {act!r} is not supported for Gemma; use gelu_pytorch_tanh")
    if c.get("use_bidirectional_attention"):
        raise BundleError("use_bidirectional_attention is not supported; batchinf runs Gemma as a causal decoder")
    base = {**common_fields(c), "tie_word_embeddings": bool(c.get("tie_word_embeddings", True))}
    rope = c.get("rope_parameters") or {}
    local_theta = (rope.get(SLIDING) or {}).get("rope_theta", c.get("rope_local_base_freq"))
    if mt == "gemma3_text" and local_theta is None:
        local_theta = 10000.0
    window = c.get("sliding_window")
    return LlamaConfig(
        **base, qkv_bias=bool(c.get("attention_bias", False)), o_bias=bool(c.get("attention_bias", False)),
        hidden_act="gelu_tanh", qk_norm=mt == "gemma3_text", norm_offset=True, sandwich_norms=True,
        embed_scale=float(base["hidden_size"]) ** 0.5,
        attn_scale=float(c.get("query_pre_attn_scalar") or base["head_dim"]) ** -0.5,
        attn_softcap=_cap(c.get("attn_logit_softcapping")), final_softcap=_cap(c.get("final_logit_softcapping")),
        layer_types=_layer_types(c, base["num_hidden_layers"]), local_window=int(window) if window else None,
        local_rope_theta=float(local_theta) if local_theta is not None else None,
    )


def _cap(value: Any) -> float | None:
    return float(value) if value else None
