"""The decoder's configuration: one dataclass for every native decoder family, whose flags say
where a family departs from Llama (q/k norms, Gemma's norm offsets and soft-capping, per-layer
sliding windows and rope bases), and the rotary frequencies it implies."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from batchinf.errors import BundleError

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None       # Mistral: every layer; caps the context instead
    # Where a family departs from Llama:
    hidden_act: str = "silu"                # or gelu_tanh
    qk_norm: bool = False                   # Qwen3, Gemma 3: RMSNorm over each head of q and k
    norm_offset: bool = False               # Gemma: RMSNorm scales by (1 + w), in float32
    sandwich_norms: bool = False            # Gemma 2/3: norms after attention and MLP as well
    embed_scale: float | None = None        # Gemma: embeddings times sqrt(hidden)
    attn_scale: float | None = None         # Gemma: query_pre_attn_scalar ** -0.5
    attn_softcap: float | None = None       # Gemma 2: tanh soft-capping of attention scores
    final_softcap: float | None = None      # Gemma 2: tanh soft-capping of the logits
    layer_types: tuple[str, ...] | None = None   # per layer: sliding_attention or full_attention
    local_window: int | None = None         # window of the sliding_attention layers
    local_rope_theta: float | None = None   # Gemma 3: rope base of the sliding layers (unscaled)
    bidirectional: bool = False             # EmbeddingGemma: an encoder, every token sees every other

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> LlamaConfig:
        mt = c.get("model_type")
        if mt not in LLAMA_TYPES:
            raise BundleError(f"model_type {mt!r} is not a Llama-family decoder; supported: {', '.join(LLAMA_TYPES)}")
        if c.get("hidden_act", "silu") != "silu":
            raise BundleError(f"hidden_act {c['hidden_act']!r} is not supported; Llama-family models use silu")
        window = c.get("sliding_window") if (mt == "mistral" or c.get("use_sliding_window")) else None
        return cls(**common_fields(c), qkv_bias=mt == "qwen2" or bool(c.get("attention_bias", False)),
                   o_bias=mt != "qwen2" and bool(c.get("attention_bias", False)),
                   mlp_bias=bool(c.get("mlp_bias", False)), sliding_window=int(window) if window else None,
                   qk_norm=mt == "qwen3")

    @property
    def context_length(self) -> int:
        # Sliding-window attention equals full attention while sequences fit in the window.
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.local_window and self.layer_types and self.layer_types[layer] == SLIDING)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def common_fields(c: dict[str, Any]) -> dict[str, Any]:
    """The fields every decoder family's config.json spells alike (transformers 4 and 5 layouts)."""
    try:
        heads = int(c["num_attention_heads"])
        rope = c.get("rope_parameters") or {}  # transformers >= 5 folds theta+scaling into this
        if FULL in rope:                        # per layer type (Gemma 3): the global layers'
            rope = rope[FULL]
        scaling = c.get("rope_scaling") or ({**rope} if rope.get("rope_type", "default") != "default" else None)
        return dict(
            model_type=c["model_type"], vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]), num_hidden_layers=int(c["num_hidden_layers"]),
            num_attention_heads=heads, num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling, tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"config.json lacks a required field or has a bad value: {e}") from e


def rope_inv_freq(cfg: LlamaConfig, theta: float | None = None, scaled: bool = True) -> Tensor:
    """[Dh/2] inverse frequencies, with HF's "linear" and "llama3" scalings. On the CPU even inside
    `empty_weights()`: a meta tensor's arithmetic runs torch's reference kernels, whose first use
    imports torch._dynamo (2.4 s and its memory in every worker that builds a decoder)."""
    d = cfg.head_dim
    inv = 1.0 / ((theta or cfg.rope_theta) ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    sc = (cfg.rope_scaling or {}) if scaled else {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled_inv = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled_inv / factor + smooth * scaled_inv
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled_inv)
    raise BundleError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")
