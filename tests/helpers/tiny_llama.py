"""Tiny, random, complete HF Llama-family model directories (llama, mistral, qwen2) for fast tests.

The tokenizer is a byte-level BPE trained on a fixed word list (deterministic), with ChatML special
tokens and a ChatML chat template, like SmolLM2-Instruct's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tests.helpers.tiny_models import COMMON_WORDS

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
              "mlp_bias": False, "tie_word_embeddings": True,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None,
                "tie_word_embeddings": False},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
              "tie_word_embeddings": False, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
}


def build_tokenizer(vocab_size: int = 400) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [" ".join(COMMON_WORDS[i:] + COMMON_WORDS[:i]) for i in range(0, len(COMMON_WORDS), 7)]
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    D, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    Dh = D // H

    def normal(*shape: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    qkv_bias = cfg.get("attention_bias", False) or cfg["model_type"] == "qwen2"
    w = {"model.embed_tokens.weight": normal(V, D, std=0.5), "model.norm.weight": 1.0 + normal(D, std=0.1)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, d_out in (("q_proj", H * Dh), ("k_proj", KV * Dh), ("v_proj", KV * Dh)):
            w[f"{p}.self_attn.{name}.weight"] = normal(d_out, D)
            if qkv_bias:
                w[f"{p}.self_attn.{name}.bias"] = normal(d_out, std=0.05)
        w[f"{p}.self_attn.o_proj.weight"] = normal(D, H * Dh)
        w[f"{p}.mlp.gate_proj.weight"] = normal(I, D)
        w[f"{p}.mlp.up_proj.weight"] = normal(I, D)
        w[f"{p}.mlp.down_proj.weight"] = normal(D, I)
        w[f"{p}.input_layernorm.weight"] = 1.0 + normal(D, std=0.1)
        w[f"{p}.post_attention_layernorm.weight"] = 1.0 + normal(D, std=0.1)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(V, D, std=0.3)
    return {k: v.contiguous() for k, v in w.items()}


def _write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))


def make_tiny_llama(dir: Path, *, family: str = "llama", hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, intermediate: int = 128, max_position: int = 256, seed: int = 0,
                    rope_theta: float = 10000.0, tokenizer: Tokenizer | None = None) -> Path:
    """Write a loadable (transformers and batchinf) tiny decoder of `family` into `dir`; `tokenizer`
    (default: the tiny trained one) needs the ChatML special tokens."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or build_tokenizer()
    eos_id, bos_id = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")
    cfg = {
        **FAMILIES[family],
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_position,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "hidden_act": "silu",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    _write_json(dir / "config.json", cfg)
    save_file(_random_weights(cfg, seed), str(dir / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(dir, tok, max_position)
    return dir


def write_tokenizer_files(dir: Path, tok: Tokenizer, max_position: int) -> None:
    """tokenizer.json, tokenizer_config.json (ChatML template) and generation_config.json."""
    eos_id, bos_id = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")
    tok.save(str(dir / "tokenizer.json"))
    _write_json(dir / "tokenizer_config.json", {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_prefix_space": False,
        "model_max_length": max_position,
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(dir / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": [eos_id],
                                                 "do_sample": False})


def make_family_dirs(root: Path) -> dict[str, Path]:
    """One tiny model per family under `root` (seeds 0, 1, 2): family -> directory."""
    return {fam: make_tiny_llama(root / fam, family=fam, seed=i) for i, fam in enumerate(FAMILIES)}
