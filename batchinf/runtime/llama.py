"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) with a preallocated slot KV cache.

Parameter names equal HF `*ForCausalLM` state-dict keys. Two entry points drive it: `prefill`
(new prompts, right-padded, written into their cache slots) and `decode_step` (one token for each of
the first `n` slots, each at its own position). A decode step can carry a `Fill` as well: prompt
tokens of other slots (whose earlier positions already hold K/V, e.g. copied from a slot with the
same prefix) written into the cache in the same pass, so that joining a running batch costs no
forward pass of its own. A forward pass is a list of `Segment`s that share the token-wise work
(projections, MLP) and differ in how they attend.

On CPU, a Linear multiplies small batches against an MKL-packed copy of its weight where that was
measured faster (runtime/packing.py), and the KV cache's memory is committed as positions are
written and handed back as sequences end (runtime/lazy_memory.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from batchinf.runtime.weights import load_safetensors
from torch import Tensor, nn

from batchinf.config import settings
from batchinf.errors import BundleError
from batchinf.runtime.decoder_config import LLAMA_TYPES, LlamaConfig, rope_inv_freq
from batchinf.runtime.empty import empty_weights
from batchinf.runtime.gemma import GEMMA_TYPES, gemma_config
from batchinf.runtime.lazy_memory import forget, lazy_zeros
from batchinf.runtime.packing import Linear, pack_weights
from batchinf.runtime.block_weights import keep_blocks

log = logging.getLogger("batchinf.runtime")

__all__ = ["LlamaConfig", "rope_inv_freq", "MODEL_TYPES", "load_llama", "config_of"]
MODEL_TYPES = LLAMA_TYPES + GEMMA_TYPES


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:     # Gemma: (x * (1 + w)) in float32, then cast
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's rotate-half rotary: x [B, H, S, Dh], cos/sin [B, 1, S, Dh]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        H, KV, Dh, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        if H % KV:
            raise BundleError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {KV}")
        self.H, self.KV, self.Dh = H, KV, Dh
        self.q_proj = Linear(D, H * Dh, bias=cfg.qkv_bias)
        self.k_proj = Linear(D, KV * Dh, bias=cfg.qkv_bias)
        self.v_proj = Linear(D, KV * Dh, bias=cfg.qkv_bias)
        self.o_proj = Linear(H * Dh, D, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps, cfg.norm_offset)
        self.qk_norm, self.scale, self.softcap = cfg.qk_norm, cfg.attn_scale, cfg.attn_softcap
        self.sliding = cfg.is_sliding(layer)

    def forward(self, x: Tensor, segments: list[Segment], kv: LayerCache) -> Tensor:
        """x [N, D]: the tokens of every segment, flattened in order -> [N, D]."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)        # [N, H*Dh], [N, KV*Dh] x2
        ys, at = [], 0
        for p in segments:
            B, S = p.tokens.shape
            rows = slice(at, at + B * S)
            at += B * S
            qi = q[rows].view(B, S, self.H, self.Dh)
            ki = k[rows].view(B, S, self.KV, self.Dh)
            if self.qk_norm:
                qi, ki = self.q_norm(qi), self.k_norm(ki)
            qi, ki = qi.transpose(1, 2), ki.transpose(1, 2)                # [B, H, S, Dh], [B, KV, S, Dh]
            vi = v[rows].view(B, S, self.KV, self.Dh).transpose(1, 2)
            cos, sin = (p.local_rope or (p.cos, p.sin)) if self.sliding else (p.cos, p.sin)
            qi, ki = rotate(qi, cos, sin), rotate(ki, cos, sin)
            keys, values = kv.update(ki, vi, p.where)                       # [B, KV, T, Dh]
            # Grouped-query attention without copying K/V: the H/KV query heads that share a KV head
            # become extra query rows of that head: [B, H, S, Dh] -> [B, KV, (H/KV)*S, Dh].
            qi = qi.reshape(B, self.KV, self.H // self.KV * S, self.Dh)
            mask = p.where.local if self.sliding and p.where.local is not None else p.where.mask
            y = self._attend(qi, keys, values, mask)
            ys.append(y.view(B, self.H, S, self.Dh).transpose(1, 2).reshape(B * S, self.H * self.Dh))
        return self.o_proj(ys[0] if len(ys) == 1 else torch.cat(ys))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        # SDPA has no soft-capping: scores by hand, capped before the mask, softmax in float32 like HF
        scores = q @ k.transpose(-1, -2) * (self.scale or self.Dh ** -0.5)
        scores = (torch.tanh(scores / self.softcap) * self.softcap).masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        D, I, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj, self.up_proj, self.down_proj = Linear(D, I, bias=b), Linear(D, I, bias=b), Linear(I, D, bias=b)
        self.tanh_gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: Tensor) -> Tensor:
        g = self.gate_proj(x)
        g = F.gelu(g, approximate="tanh") if self.tanh_gelu else F.silu(g)
        return self.down_proj(g * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        norm = [cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset]
        self.input_layernorm = RMSNorm(*norm)
        self.post_attention_layernorm = RMSNorm(*norm)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:   # Gemma: post_attention_layernorm normalises the attention output instead
            self.pre_feedforward_layernorm = RMSNorm(*norm)
            self.post_feedforward_layernorm = RMSNorm(*norm)

    def forward(self, x: Tensor, segments: list[Segment], kv: LayerCache) -> Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), segments, kv))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), segments, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


@dataclass
class Where:
    """Where a forward pass writes and reads the cache."""
    slots: Tensor | None     # [B] cache slot of each row; None: rows are slots 0..B-1 (decode)
    pos: Tensor              # [B, S] cache position of each token, padding included
    mask: Tensor             # bool, True = attend: [B or 1, 1, rep*S, keys]
    span: int                # keys are cache positions [0, span)
    fresh: bool = False      # prefill from position 0: the keys are this pass's own K/V, no cache read
    local: Tensor | None = None  # the mask of sliding-window layers, when the model has them


@dataclass
class Segment:
    """Rows of a forward pass that attend alike."""
    tokens: Tensor           # [B, S]
    where: Where
    cos: Tensor              # rotary tables, broadcastable to [B, H, S, Dh]
    sin: Tensor
    local_rope: tuple[Tensor, Tensor] | None = None  # sliding layers' (cos, sin) when their base differs


@dataclass
class Fill:
    """Prompt tokens to write into the cache without computing logits: row b's tokens (right-padded)
    go to positions start[b].. of slot slots[b], whose positions [0, start[b]) already hold K/V."""
    tokens: Tensor           # [B, S]
    start: Tensor            # [B]
    slots: Tensor            # [B]
    lengths: Tensor          # [B] real tokens per row


class LayerCache:
    """One layer's K/V for every slot: [slots, KV, T, Dh], preallocated."""

    def __init__(self, slots: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (slots, kv_heads, capacity, head_dim)
        self.k, self.v = lazy_zeros(shape, dtype, device), lazy_zeros(shape, dtype, device)

    def update(self, k: Tensor, v: Tensor, where: Where) -> tuple[Tensor, Tensor]:
        """Write k, v [B, KV, S, Dh] at `where` -> the keys and values to attend to [B, KV, keys, Dh]."""
        B = k.shape[0]
        rows = where.slots if where.slots is not None else torch.arange(B, device=k.device)
        # Padding tokens are written too: at positions past their row's length, which the row
        # overwrites before it attends to them (clamped into the cache, which fits every real token).
        at = (rows[:, None], slice(None), where.pos.clamp(max=self.k.shape[2] - 1))
        self.k[at] = k.transpose(1, 2)                                     # [B, S, KV, Dh]
        self.v[at] = v.transpose(1, 2)
        if where.fresh:
            return k, v
        if where.slots is None:
            return self.k[:B, :, :where.span], self.v[:B, :, :where.span]
        return self.k[where.slots, :, :where.span], self.v[where.slots, :, :where.span]

    def copy_prefix(self, dst: Tensor, src: Tensor, lengths: Tensor) -> None:
        """Slot dst[i] positions [0, lengths[i]) := slot src[i]'s."""
        row = torch.repeat_interleave(torch.arange(len(dst), device=dst.device), lengths)
        col = torch.cat([torch.arange(int(n), device=dst.device) for n in lengths])
        for t in (self.k, self.v):
            t[dst[row], :, col] = t[src[row], :, col]


class KVCache:
    def __init__(self, cfg: LlamaConfig, slots: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slots, self.capacity = slots, capacity
        self.layers = [LayerCache(slots, cfg.num_key_value_heads, capacity, cfg.head_dim, dtype, device)
                       for _ in range(cfg.num_hidden_layers)]

    def move(self, src: int, dst: int, positions: int) -> None:
        """Slot dst's first `positions` positions := slot src's; slot src is then empty (its
        memory handed back, as `release`)."""
        for layer in self.layers:
            layer.k[dst, :, :positions].copy_(layer.k[src, :, :positions])   # [KV, n, Dh]
            layer.v[dst, :, :positions].copy_(layer.v[src, :, :positions])
            forget(layer.k, src)
            forget(layer.v, src)

    def release(self, slot: int) -> None:
        """A finished sequence's slot: its memory handed back (lazy_zeros), so the cache holds the
        positions of live sequences, not every slot's high-water mark."""
        for layer in self.layers:
            forget(layer.k, slot)
            forget(layer.v, slot)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.inv_freq = rope_inv_freq(cfg)  # [Dh/2] fp32, a plain attribute so .to(dtype) keeps it fp32
        self.local_inv_freq = rope_inv_freq(cfg, cfg.local_rope_theta, scaled=False) \
            if cfg.local_rope_theta else None
        self.windowed = any(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers))

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """What it computes in (its projections may be held as GGUF blocks: runtime/block_weights.py)."""
        return self.model.norm.weight.dtype

    def new_cache(self, slots: int, capacity: int) -> KVCache:
        return KVCache(self.config, slots, capacity, self.dtype, self.device)

    def _rope(self, pos: Tensor, dtype: torch.dtype, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
        freqs = pos.float()[..., None] * inv_freq                  # [..., Dh/2], fp32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]

    def _segment(self, tokens: Tensor, qpos: Tensor, where_pos: Tensor, slots: Tensor | None, span: int,
              fresh: bool = False) -> Segment:
        """Rows whose queries sit at positions qpos [B or 1, S] and attend causally to cache
        positions [0, span) (and, in sliding layers, to the last `local_window` of them)."""
        S = qpos.shape[1]
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        keys = torch.arange(span, device=tokens.device)
        causal = keys[None, None, :] <= qpos[:, :, None]                             # [B, S, span]

        def heads(m: Tensor) -> Tensor:     # the H/KV query heads of a KV head are extra query rows
            return m[:, None] if S == 1 else m.repeat(1, rep, 1)[:, None]              # [B, 1, rep*S, span]

        local = None
        if self.windowed:
            local = heads(causal & (keys[None, None, :] > qpos[:, :, None] - self.config.local_window))
        dtype = self.dtype
        cos, sin = self._rope(qpos, dtype, self.inv_freq)                           # [B, 1, S, Dh]
        local_rope = self._rope(qpos, dtype, self.local_inv_freq) if self.local_inv_freq is not None else None
        return Segment(tokens, Where(slots, where_pos, heads(causal), span, fresh, local), cos, sin, local_rope)

    def _logits(self, h: Tensor) -> Tensor:
        logits = self.lm_head(h).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _run(self, segments: list[Segment], cache: KVCache) -> Tensor:
        """Every segment's tokens through the decoder -> final hidden states [N, D], segments in order."""
        tokens = segments[0].tokens.reshape(-1) if len(segments) == 1 else torch.cat([p.tokens.reshape(-1) for p in segments])
        x = self.model.embed_tokens(tokens)                        # [N, D]
        if self.config.embed_scale is not None:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        for layer, kv in zip(self.model.layers, cache.layers):
            x = layer(x, segments, kv)
        return self.model.norm(x)

    def prefill(self, tokens: Tensor, lengths: Tensor, slots: Tensor, cache: KVCache,
                all_logits: bool = False) -> Tensor:
        """tokens [B, S] right-padded, lengths [B], slots [B] -> logits at each row's last real token
        [B, V] (or at every position [B, S, V]). Causal attention alone keeps padding invisible to
        real tokens, because padding only follows them."""
        B, S = tokens.shape
        pos = torch.arange(S, device=tokens.device)
        segment = self._segment(tokens, pos[None], pos.expand(B, S), slots, S, fresh=True)
        h = self._run([segment], cache).view(B, S, -1)
        if all_logits:
            return self._logits(h)
        return self._logits(h[torch.arange(B, device=h.device), lengths - 1])

    def decode_step(self, tokens: Tensor, pos: Tensor, cache: KVCache, fill: Fill | None = None) -> Tensor:
        """tokens [B], pos [B] for cache slots 0..B-1 -> next-token logits [B, V]. `fill` is written
        first in every layer, so decode rows of the filled slots see it."""
        segments = [self._fill_segment(fill)] if fill is not None else []
        segments.append(self._segment(tokens[:, None], pos[:, None], pos[:, None], None, int(pos.max()) + 1))
        h = self._run(segments, cache)
        return self._logits(h[-len(tokens):])

    def fill(self, fill: Fill, cache: KVCache) -> None:
        """A Fill on its own (when it is too large to ride along a decode step)."""
        self._run([self._fill_segment(fill)], cache)

    def _fill_segment(self, f: Fill) -> Segment:
        pos = f.start[:, None] + torch.arange(f.tokens.shape[1], device=f.tokens.device)  # [B, S]
        return self._segment(f.tokens, pos, pos, f.slots, int((f.start + f.lengths).max()))


def config_of(c: dict[str, Any]) -> LlamaConfig:
    """The decoder configuration of an HF config.json, by its family."""
    return gemma_config(c) if c.get("model_type") in GEMMA_TYPES else LlamaConfig.from_hf(c)


def read_config(model_dir: Path) -> LlamaConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise BundleError(f"{path} not found; a model directory needs an HF config.json")
    return config_of(json.loads(path.read_text()))


def load_llama(model_dir: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               backbone_only: bool = False) -> LlamaForCausalLM:
    """The decoder of a model directory. backbone_only: for its hidden states (an embedding model):
    checkpoints of the bare model (keys without `model.`) load, and any lm_head is ignored."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BundleError(f"no *.safetensors weights in {model_dir}; only safetensors are loaded")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_safetensors(f, device))
    if backbone_only:
        state = {k if k.startswith("model.") else "model." + k: v for k, v in state.items() if k != "lm_head.weight"}
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")  # unused; shares the tensor
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        if not cfg.tie_word_embeddings:
            raise BundleError(f"weights in {model_dir} lack lm_head.weight and config.json does not tie embeddings")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with empty_weights():
        model = LlamaForCausalLM(cfg)
    want = set(model.state_dict())
    missing, extra = sorted(want - set(state)), sorted(k for k in set(state) - want if "rotary_emb" not in k)
    if missing or extra:
        raise BundleError(f"weights in {model_dir} do not match config.json: missing {missing[:5]}, "
                          f"unexpected {extra[:5]}")
    try:
        model.load_state_dict({k: state[k] for k in want}, strict=True, assign=True)
    except RuntimeError as e:
        raise BundleError(f"weights in {model_dir} do not match config.json: {e}") from e
    model = model.to(device=device, dtype=dtype).eval()
    model.inv_freq = rope_inv_freq(cfg).to(device)  # stays fp32, like HF's rotary embedding
    if cfg.local_rope_theta:
        model.local_inv_freq = rope_inv_freq(cfg, cfg.local_rope_theta, scaled=False).to(device)
    if settings().block_weights and torch.device(device).type == "cpu" and dtype == torch.float32 \
            and not backbone_only:
        log.info("%s: %d weights kept as GGUF blocks (BATCHINF_BLOCK_WEIGHTS)", model_dir.name,
                 keep_blocks(model, Linear))
    pack_weights(model)
    return model
