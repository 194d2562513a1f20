"""A native decoder (runtime/llama.py's families) as a text encoder: its final hidden states,
which sentence-transformers' pooling (e.g. Qwen3-Embedding's last token) turns into embeddings.
Checkpoints saved from the bare model (`Qwen3Model`: keys without `model.`, no lm_head) load too.
A bidirectional one (EmbeddingGemma's `use_bidirectional_attention`) attends both ways, padding
masked out, instead of causally."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from batchinf.runtime.llama import KVCache, LlamaForCausalLM, load_llama


class DecoderEncoder(nn.Module):
    def __init__(self, decoder: LlamaForCausalLM) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Right-padded input_ids [B, S] -> final hidden states [B, S, D] (causal attention keeps
        padding, which only follows real tokens, out of them)."""
        B, S = input_ids.shape
        d = self.decoder
        cache = KVCache(d.config, B, S, d.dtype, input_ids.device)
        pos = torch.arange(S, device=input_ids.device)
        segment = d._segment(input_ids, pos[None], pos.expand(B, S), torch.arange(B, device=input_ids.device), S,
                             fresh=True)
        if d.config.bidirectional:
            segment.where.mask, segment.where.local = bidirectional_masks(attention_mask.bool(), d.config)
        return d._run([segment], cache).view(B, S, -1)


def bidirectional_masks(valid: Tensor, cfg: Any) -> tuple[Tensor, Tensor | None]:
    """EmbeddingGemma's attention (as transformers builds it): every query sees every real key;
    in sliding layers only those less than `local_window` positions away, on either side.
    valid [B, S] -> masks [B, 1, rep*S, S] (the H/KV query heads of a KV head are extra rows)."""
    S = valid.shape[1]
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    full = valid[:, None, :].expand(-1, S, -1)                                      # [B, S, S]
    pos = torch.arange(S, device=valid.device)
    near = (pos[None, :] - pos[:, None]).abs() < cfg.local_window if cfg.local_window else None
    local = full & near if near is not None else None
    return (full.repeat(1, rep, 1)[:, None],
            local.repeat(1, rep, 1)[:, None] if local is not None else None)


def load_decoder_encoder(model_dir: Path, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32) -> DecoderEncoder:
    return DecoderEncoder(load_llama(model_dir, device=device, dtype=dtype, backbone_only=True))
