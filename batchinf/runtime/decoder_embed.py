"""A native decoder (runtime/llama.py's families) as a text encoder: its final hidden states,
which sentence-transformers' pooling (e.g. Qwen3-Embedding's last token) turns into embeddings.
Checkpoints saved from the bare model (`Qwen3Model`: keys without `model.`, no lm_head) load too."""

from __future__ import annotations

from pathlib import Path

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
        cache = KVCache(d.config, B, S, d.lm_head.weight.dtype, input_ids.device)
        pos = torch.arange(S, device=input_ids.device)
        part = d._part(input_ids, pos[None], pos.expand(B, S), torch.arange(B, device=input_ids.device), S,
                       fresh=True)
        return d._run([part], cache).view(B, S, -1)


def load_decoder_encoder(model_dir: Path, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32) -> DecoderEncoder:
    return DecoderEncoder(load_llama(model_dir, device=device, dtype=dtype, backbone_only=True))
