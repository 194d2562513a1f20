"""Tiny random-weight Qwen3, Gemma 2 and Gemma 3 (text) model directories, built and saved by
transformers itself (its config classes and random init), with the tiny ChatML tokenizer. Norm
weights are randomised too (Gemma's start at zero), so a missing (1 + w) offset shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny_llama import build_tokenizer, write_tokenizer_files

WINDOW = 8      # sliding window of the tiny Gemmas: the parity texts run well past it

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {"cls": "Qwen3Config", "rope_theta": 10000.0},
    "gemma2": {"cls": "Gemma2Config", "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
               "final_logit_softcapping": 3.0, "sliding_window": WINDOW, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"cls": "Gemma3TextConfig", "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}},
}


def make_tiny_decoder(dir: Path, family: str, *, seed: int = 0, layers: int = 3) -> Path:
    import transformers

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    spec = dict(CONFIGS[family])
    cfg = getattr(transformers, spec.pop("cls"))(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=tok.token_to_id("<|im_start|>"), eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|im_end|>"), tie_word_embeddings=family != "qwen3", **spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.1 if "norm" in name else 0.3
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if "norm" in name and family == "qwen3" else 0))
    model.save_pretrained(dir, safe_serialization=True)
    write_tokenizer_files(dir, tok, 256)
    return dir
