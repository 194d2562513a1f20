"""The transformers fallback for generation: a causal LM whose architecture has no native decoder
(GPT-2, GPT-NeoX/Pythia, OPT, Phi, Falcon, ...) runs through transformers' own
`AutoModelForCausalLM`, behind the interface `runtime/generation/engine.py`'s continuous batching drives
(`prefill`, `decode_step`, a cache of slots, `lm_head`, `config`).

Each slot holds its own transformers `DynamicCache` of batch size 1, and every forward pass is
one sequence's: the scheduler (admission by token budget, longest max_tokens first, refilling
freed slots, stop strings, per-record seeded sampling) is the native one, but rows are not
stacked into one matrix product. That keeps a record's output exactly what transformers computes
for it alone, whatever else shares its batch (no padding, no position ids or attention masks to
get right per architecture: OPT derives positions from the mask, GPT-2 adds learned ones), at
the cost of throughput. Prefix sharing is off (the runtime never asks for it here)."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from batchinf.errors import BundleError
from batchinf.runtime.hf_fallback import from_pretrained, transformers_module


@dataclass(frozen=True)
class CacheShape:
    """What the runtime reads of a decoder's config to size its KV budget."""
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


def cache_shape(config: dict[str, Any]) -> CacheShape:
    """The K/V footprint of an HF config, whatever its field names (GPT-2: n_layer/n_head/n_embd)."""
    def first(*names: str, default: int = 0) -> int:
        return next((int(config[n]) for n in names if isinstance(config.get(n), int) and config[n] > 0), default)

    layers = first("num_hidden_layers", "n_layer", "num_layers", default=1)
    heads = first("num_attention_heads", "n_head", "num_heads", default=1)
    hidden = first("hidden_size", "n_embd", "d_model", "word_embed_proj_dim", default=heads)
    kv = first("num_key_value_heads", "n_head_kv", "num_kv_heads", default=heads)
    if config.get("multi_query") is True:   # Falcon's single K/V head
        kv = 1
    return CacheShape(layers, kv, first("head_dim", default=max(1, hidden // heads)))


def context_length(config: dict[str, Any]) -> int:
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_seq_len"):
        if isinstance(config.get(name), int) and config[name] > 0:
            return int(config[name])
    return 2048     # rotary models without a declared limit (Falcon): transformers' own default


class SlotCaches:
    """One transformers cache (batch 1) per slot; None while the slot is free."""

    def __init__(self, slots: int) -> None:
        self.slots: list[Any] = [None] * slots

    def move(self, src: int, dst: int, positions: int) -> None:
        self.slots[dst], self.slots[src] = self.slots[src], None


class TransformersDecoder(nn.Module):
    """transformers' causal LM under the native decoder's interface (see the module docstring)."""

    def __init__(self, model: nn.Module, config: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.config = cache_shape(config)
        head = model.get_output_embeddings()
        if head is None:
            raise BundleError("the model has no output embeddings (an LM head); it cannot generate")
        self.lm_head = head
        # transformers 5 renamed forward's past_key_values to cache (the old name warns, then goes)
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, slots: int, capacity: int) -> SlotCaches:
        return SlotCaches(slots)

    def _forward(self, ids: Tensor, past: Any) -> tuple[Tensor, Any]:
        """ids [S] continuing `past` (None: a new sequence) -> (logits [S, V] float32, the cache)."""
        if past is None:
            past = transformers_module().DynamicCache()
        out = self.model(input_ids=ids[None], use_cache=True, **{self._cache_arg: past})
        return out.logits[0].float(), past      # the cache grows in place

    def prefill(self, tokens: Tensor, lengths: Tensor, slots: Tensor, cache: SlotCaches,
                all_logits: bool = False) -> Tensor:
        """tokens [B, S] right-padded, lengths [B], slots [B] -> logits at each row's last real
        token [B, V] (or at every position [B, S, V], padding rows zero)."""
        B, S = tokens.shape
        rows = []
        for b in range(B):
            n = int(lengths[b])
            logits, cache.slots[int(slots[b])] = self._forward(tokens[b, :n], None)
            rows.append(torch.cat([logits, logits.new_zeros(S - n, logits.shape[1])]) if all_logits else logits[-1])
        return torch.stack(rows)

    def decode_step(self, tokens: Tensor, pos: Tensor, cache: SlotCaches, fill: Any = None) -> Tensor:
        """tokens [B], pos [B] for slots 0..B-1 -> next-token logits [B, V]. A row whose cache
        already holds position pos (a finished sequence, kept until it is collected) or a free
        slot is not computed: its logits row is zero and unread."""
        if fill is not None:
            raise ValueError("the transformers fallback does not share prompt prefixes")
        out: list[Tensor | None] = []
        for i in range(len(tokens)):
            past = cache.slots[i]
            if past is None or past.get_seq_length() != int(pos[i]):
                out.append(None)
                continue
            logits, cache.slots[i] = self._forward(tokens[i:i + 1], past)
            out.append(logits[-1])
        width = next((r.shape[0] for r in out if r is not None), self.lm_head.weight.shape[0])
        return torch.stack([r if r is not None else torch.zeros(width, device=self.device) for r in out])


def load_transformers_decoder(model_dir: Path, device: str = "cpu", dtype: Any = None) -> TransformersDecoder:
    model = from_pretrained(model_dir, "AutoModelForCausalLM", device, dtype)
    return TransformersDecoder(model, json.loads((Path(model_dir) / "config.json").read_text()))
