"""Per-architecture knowledge for GGUF import: which `general.architecture` values batchinf converts,
how llama.cpp's tensor names map back to HF's, and the config.json fields a family needs beyond
Llama's, read from `{arch}.*` metadata.

What llama.cpp's converter (convert_hf_to_gguf.py) changes and this module undoes or re-derives:
- `llama` (also Mistral, which it writes as `llama`): Q/K rows permuted (undone in gguf.py).
- Gemma 2/3: every `*norm.weight` is stored with Gemma's +1 folded in (llama.cpp's RMSNorm scales by w,
  HF's by 1 + w), so 1 is subtracted again; query_pre_attn_scalar is not stored (llama.cpp uses
  head_dim, or hidden / heads for the 27B models, which it recognises by their layer count); Gemma 3's
  layer pattern is not stored either (llama.cpp: every sixth layer global) unless the file carries
  `attention.sliding_window_pattern`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from batchinf.errors import BundleError


@dataclass(frozen=True)
class Arch:
    model_type: str
    hf_arch: str
    permuted: bool = False          # llama.cpp permuted the Q/K rows
    qk_norm: bool = False
    gemma: bool = False


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", "LlamaForCausalLM", permuted=True),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM"),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", qk_norm=True),
    "gemma2": Arch("gemma2", "Gemma2ForCausalLM", gemma=True),
    "gemma3": Arch("gemma3_text", "Gemma3ForCausalLM", qk_norm=True, gemma=True),
}

_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                "attn_v.weight": "self_attn.v_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
                "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
                "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
                "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
# Gemma's sandwich: ffn_norm is the norm before the MLP, post_attention_norm the one after attention.
_GEMMA_NORM_NAMES = {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                     "post_attention_norm.weight": "post_attention_layernorm.weight",
                     "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}   # llama.cpp scales their queries by hidden / heads


def arch_of(meta: dict[str, Any], path: object) -> Arch:
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise BundleError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHS)} "
                          "(Mistral files are written as `llama`)")
    return ARCHS[arch]


def layer_names(a: Arch) -> dict[str, str]:
    names = dict(_LAYER_NAMES)
    if a.qk_norm:
        names.update(_QK_NORM_NAMES)
    if a.gemma:
        names.update(_GEMMA_NORM_NAMES)
    return names


def hf_tensor_name(a: Arch, name: str, names: dict[str, str]) -> str | None:
    """HF's name of a GGUF tensor, or None when this architecture has no such tensor."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def norm_shift(a: Arch, name: str) -> float:
    """What to add to a tensor to undo the converter's norm offset (Gemma: -1 on every norm weight)."""
    return -1.0 if a.gemma and name.endswith("norm.weight") else 0.0


def family_config(a: Arch, arch: str, key: Callable[..., Any], config: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields beyond Llama's for this family (Gemma's; nothing for the others)."""
    if not a.gemma:
        return {}
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    scalar = (config["hidden_size"] // heads if layers == GEMMA_27B_LAYERS[arch] else config["head_dim"])
    window = key("attention.sliding_window", 0)
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
        "sliding_window": int(window) if window else None,
        "final_logit_softcapping": _float_or_none(key("final_logit_softcapping", 0)),
        "layer_types": layer_types(key("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6), layers),
    }
    if arch == "gemma2":
        out["attn_logit_softcapping"] = _float_or_none(key("attn_logit_softcapping", 0))
    else:                           # transformers 5's per-layer-type rope
        scaling = config.pop("rope_scaling", None) or {"rope_type": "default"}
        out["rope_parameters"] = {
            "full_attention": {**scaling, "rope_theta": config["rope_theta"]},
            "sliding_attention": {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))}}
    return out


def layer_types(pattern: Any, layers: int) -> list[str]:
    """Per-layer attention kinds from `attention.sliding_window_pattern`: one bool per layer (True:
    sliding), or a period n (every n-th layer global, as llama.cpp's set_swa_pattern)."""
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise BundleError(f"attention.sliding_window_pattern lists {len(pattern)} layers, the model has {layers}")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    n = int(pattern)
    if n < 1:
        raise BundleError(f"attention.sliding_window_pattern {n} must be at least 1")
    return ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]


def _float_or_none(value: Any) -> float | None:
    return float(value) if value else None
