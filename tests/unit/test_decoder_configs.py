"""config.json of the decoder families as the Hub ships them (transformers 4 layout) and as
transformers 5 saves them: the flags the shared decoder runs by."""

from __future__ import annotations

import pytest

from batchinf.errors import BundleError
from batchinf.runtime.decoder_config import FULL, SLIDING, rope_inv_freq
from batchinf.runtime.llama import config_of

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 8192}


def test_gemma2_hub_config() -> None:
    cfg = config_of({**BASE, "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 10000.0,
                     "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                     "sliding_window": 4096})
    assert cfg.layer_types == (SLIDING, FULL) * 3 and cfg.local_window == 4096
    assert cfg.attn_scale == 256 ** -0.5 and (cfg.attn_softcap, cfg.final_softcap) == (50.0, 30.0)
    assert cfg.norm_offset and cfg.sandwich_norms and cfg.embed_scale == 8.0 and not cfg.qk_norm
    assert cfg.tie_word_embeddings and cfg.local_rope_theta is None and cfg.context_length == 8192


def test_gemma3_hub_config_local_and_global_rope() -> None:
    cfg = config_of({**BASE, "model_type": "gemma3_text", "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                     "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
                     "sliding_window_pattern": 6, "query_pre_attn_scalar": 256})
    assert cfg.layer_types == (SLIDING,) * 5 + (FULL,) and cfg.qk_norm and cfg.final_softcap is None
    glob, local = rope_inv_freq(cfg), rope_inv_freq(cfg, cfg.local_rope_theta, scaled=False)
    assert glob[0].item() == pytest.approx(1 / 8) and local[0].item() == 1.0
    assert local[-1].item() == pytest.approx(10000.0 ** (-30 / 32))


def test_qwen3_and_refusals() -> None:
    cfg = config_of({**BASE, "model_type": "qwen3", "hidden_act": "silu", "attention_bias": False})
    assert cfg.qk_norm and not cfg.qkv_bias and not cfg.norm_offset
    with pytest.raises(BundleError, match="hidden_activation"):
        config_of({**BASE, "model_type": "gemma2", "hidden_activation": "relu"})
    with pytest.raises(BundleError, match="layer_types"):
        config_of({**BASE, "model_type": "gemma2", "layer_types": ["sliding_attention"]})
    with pytest.raises(BundleError, match="bidirectional"):
        config_of({**BASE, "model_type": "gemma3_text", "use_bidirectional_attention": True})
