"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) with a preallocated slot KV cache.

Parameter names equal HF `*ForCausalLM` state-dict keys. Two entry points drive it: `prefill`
(new prompts, right-padded, written into their cache slots) and `decode_step` (one token for each of
the first `n` slots, each at its own position). A decode step can carry a `Fill` as well: prompt
tokens of other slots (whose earlier positions already hold K/V, e.g. copied from a slot with the
same prefix) written into the cache in the same pass, so that joining a running batch costs no
forward pass of its own. A forward pass is a list of `Part`s that share the token-wise work
(projections, MLP) and differ in how they attend.

On CPU with MKL, small-batch matmuls (decode, short prefills) run against prepacked weights
(`pack_weights`): MKL otherwise repacks each weight matrix at every call, which for a few rows costs
more than the multiplication (SmolLM2-135M, 1 thread: a decode step at 8 rows 201 -> 132 ms).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from batchinf.config import settings
from batchinf.errors import BundleError

MODEL_TYPES = ("llama", "mistral", "qwen2")
PACKED_MAX_ROWS = 128   # above this many rows MKL's own packing is amortised and plain sgemm is as fast


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
    sliding_window: int | None = None

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> LlamaConfig:
        mt = c.get("model_type")
        if mt not in MODEL_TYPES:
            raise BundleError(f"model_type {mt!r} is not a Llama-family decoder; supported: {', '.join(MODEL_TYPES)}")
        if c.get("hidden_act", "silu") != "silu":
            raise BundleError(f"hidden_act {c['hidden_act']!r} is not supported; Llama-family models use silu")
        try:
            heads = int(c["num_attention_heads"])
            rope = c.get("rope_parameters") or {}  # transformers >= 5 folds theta+scaling into this
            scaling = c.get("rope_scaling") or ({**rope} if rope.get("rope_type", "default") != "default" else None)
            window = c.get("sliding_window") if (mt == "mistral" or c.get("use_sliding_window")) else None
            return cls(
                model_type=mt, vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
                intermediate_size=int(c["intermediate_size"]), num_hidden_layers=int(c["num_hidden_layers"]),
                num_attention_heads=heads, num_key_value_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=scaling, tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                qkv_bias=mt == "qwen2" or bool(c.get("attention_bias", False)),
                o_bias=mt != "qwen2" and bool(c.get("attention_bias", False)),
                mlp_bias=bool(c.get("mlp_bias", False)), sliding_window=int(window) if window else None,
            )
        except KeyError as e:
            raise BundleError(f"config.json lacks a required field: {e}") from e

    @property
    def context_length(self) -> int:
        # Sliding-window attention equals full attention while sequences fit in the window.
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def rope_inv_freq(cfg: LlamaConfig) -> Tensor:
    """[Dh/2] inverse frequencies, with HF's "linear" and "llama3" scalings."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    raise BundleError(f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3")


class Linear(nn.Linear):
    """nn.Linear that multiplies small batches against a prepacked copy of its weight when it has one."""

    packed: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None or x.numel() > PACKED_MAX_ROWS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, self.bias, rows.shape[0])
        return y.view(*x.shape[:-1], self.out_features)


def pack_weights(model: nn.Module) -> bool:
    """Give every Linear of a CPU float32 model an MKL-packed weight, if this torch build has MKL and
    the packed product equals the plain one (checked per weight shape) -> whether it packed.
    Costs one more copy of the weights in memory; BATCHINF_PACK_WEIGHTS=0 turns it off."""
    if not settings().pack_weights or not torch.backends.mkl.is_available() \
            or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return False
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or any(m.weight.device.type != "cpu" or m.weight.dtype != torch.float32 for m in linears):
        return False
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        packed = [torch.ops.mkl._mkl_reorder_linear_weight(m.weight, PACKED_MAX_ROWS) for m in linears]
        checked: set[tuple[int, int]] = set()
        for m, w in zip(linears, packed):
            if m.weight.shape in checked:
                continue
            for rows in (1, 5, 64):     # one packed layout serves every row count: verify it does
                x = torch.randn(rows, m.in_features, generator=gen)
                got = torch.ops.mkl._mkl_linear(x, w, m.weight, None, rows)
                if not torch.allclose(got, F.linear(x, m.weight), rtol=1e-4, atol=1e-4):
                    return False
            checked.add(tuple(m.weight.shape))
    for m, w in zip(linears, packed):
        m.packed = w
    return True


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's rotate-half rotary: x [B, H, S, Dh], cos/sin [B, 1, S, Dh]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        H, KV, Dh, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        if H % KV:
            raise BundleError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {KV}")
        self.H, self.KV, self.Dh = H, KV, Dh
        self.q_proj = Linear(D, H * Dh, bias=cfg.qkv_bias)
        self.k_proj = Linear(D, KV * Dh, bias=cfg.qkv_bias)
        self.v_proj = Linear(D, KV * Dh, bias=cfg.qkv_bias)
        self.o_proj = Linear(H * Dh, D, bias=cfg.o_bias)

    def forward(self, x: Tensor, parts: list[Part], kv: LayerCache) -> Tensor:
        """x [N, D]: the tokens of every part, flattened in order -> [N, D]."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)        # [N, H*Dh], [N, KV*Dh] x2
        ys, at = [], 0
        for p in parts:
            B, S = p.tokens.shape
            rows = slice(at, at + B * S)
            at += B * S
            qi = q[rows].view(B, S, self.H, self.Dh).transpose(1, 2)       # [B, H, S, Dh]
            ki = k[rows].view(B, S, self.KV, self.Dh).transpose(1, 2)      # [B, KV, S, Dh]
            vi = v[rows].view(B, S, self.KV, self.Dh).transpose(1, 2)
            qi, ki = rotate(qi, p.cos, p.sin), rotate(ki, p.cos, p.sin)
            keys, values = kv.update(ki, vi, p.where)                       # [B, KV, T, Dh]
            # Grouped-query attention without copying K/V: the H/KV query heads that share a KV head
            # become extra query rows of that head: [B, H, S, Dh] -> [B, KV, (H/KV)*S, Dh].
            qi = qi.reshape(B, self.KV, self.H // self.KV * S, self.Dh)
            y = F.scaled_dot_product_attention(qi, keys, values, attn_mask=p.where.mask)
            ys.append(y.view(B, self.H, S, self.Dh).transpose(1, 2).reshape(B * S, self.H * self.Dh))
        return self.o_proj(ys[0] if len(ys) == 1 else torch.cat(ys))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        D, I, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj, self.up_proj, self.down_proj = Linear(D, I, bias=b), Linear(D, I, bias=b), Linear(I, D, bias=b)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, parts: list[Part], kv: LayerCache) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), parts, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class Where:
    """Where a forward pass writes and reads the cache."""
    slots: Tensor | None     # [B] cache slot of each row; None: rows are slots 0..B-1 (decode)
    pos: Tensor              # [B, S] cache position of each token, padding included
    mask: Tensor             # bool, True = attend: [B or 1, 1, rep*S, keys]
    span: int                # keys are cache positions [0, span)
    fresh: bool = False      # prefill from position 0: the keys are this pass's own K/V, no cache read


@dataclass
class Part:
    """Rows of a forward pass that attend alike."""
    tokens: Tensor           # [B, S]
    where: Where
    cos: Tensor              # rotary tables, broadcastable to [B, H, S, Dh]
    sin: Tensor


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
        self.k = torch.zeros(slots, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

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


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.inv_freq = rope_inv_freq(cfg)  # [Dh/2] fp32, a plain attribute so .to(dtype) keeps it fp32

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def _rope(self, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = pos.float()[..., None] * self.inv_freq             # [..., Dh/2], fp32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _run(self, parts: list[Part], cache: KVCache) -> Tensor:
        """Every part's tokens through the decoder -> final hidden states [N, D], parts in order."""
        tokens = parts[0].tokens.reshape(-1) if len(parts) == 1 else torch.cat([p.tokens.reshape(-1) for p in parts])
        x = self.model.embed_tokens(tokens)                        # [N, D]
        for layer, kv in zip(self.model.layers, cache.layers):
            x = layer(x, parts, kv)
        return self.model.norm(x)

    def prefill(self, tokens: Tensor, lengths: Tensor, slots: Tensor, cache: KVCache,
                all_logits: bool = False) -> Tensor:
        """tokens [B, S] right-padded, lengths [B], slots [B] -> logits at each row's last real token
        [B, V] (or at every position [B, S, V]). Causal attention alone keeps padding invisible to
        real tokens, because padding only follows them."""
        B, S = tokens.shape
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        pos = torch.arange(S, device=tokens.device)
        causal = torch.ones(S, S, dtype=torch.bool, device=tokens.device).tril()
        mask = causal.repeat(rep, 1)[None, None]                   # [1, 1, rep*S, S]
        cos, sin = self._rope(pos, self.lm_head.weight.dtype)      # [S, Dh]
        part = Part(tokens, Where(slots, pos.expand(B, S), mask, S, fresh=True), cos[None, None], sin[None, None])
        h = self._run([part], cache).view(B, S, -1)
        if all_logits:
            return self.lm_head(h).float()
        return self.lm_head(h[torch.arange(B, device=h.device), lengths - 1]).float()

    def decode_step(self, tokens: Tensor, pos: Tensor, cache: KVCache, fill: Fill | None = None) -> Tensor:
        """tokens [B], pos [B] for cache slots 0..B-1 -> next-token logits [B, V]. `fill` is written
        first in every layer, so decode rows of the filled slots see it."""
        parts = [self._fill_part(fill)] if fill is not None else []
        span = int(pos.max()) + 1
        keys = torch.arange(span, device=tokens.device)
        mask = (keys[None, :] <= pos[:, None])[:, None, None, :]   # [B, 1, 1, span]
        cos, sin = self._rope(pos[:, None], self.lm_head.weight.dtype)  # [B, 1, Dh]
        parts.append(Part(tokens[:, None], Where(None, pos[:, None], mask, span), cos[:, None], sin[:, None]))
        h = self._run(parts, cache)
        return self.lm_head(h[-len(tokens):]).float()

    def fill(self, fill: Fill, cache: KVCache) -> None:
        """A Fill on its own (when it is too large to ride along a decode step)."""
        self._run([self._fill_part(fill)], cache)

    def _fill_part(self, f: Fill) -> Part:
        B, S = f.tokens.shape
        rep = self.config.num_attention_heads // self.config.num_key_value_heads
        pos = f.start[:, None] + torch.arange(S, device=f.tokens.device)               # [B, S]
        span = int((f.start + f.lengths).max())
        keys = torch.arange(span, device=f.tokens.device)
        mask = (keys[None, None, :] <= pos[:, :, None]).repeat(1, rep, 1)[:, None]  # [B, 1, rep*S, span]
        cos, sin = self._rope(pos, self.lm_head.weight.dtype)                      # [B, S, Dh]
        return Part(f.tokens, Where(f.slots, pos, mask, span), cos[:, None], sin[:, None])


def read_config(model_dir: Path) -> LlamaConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise BundleError(f"{path} not found; a model directory needs an HF config.json")
    return LlamaConfig.from_hf(json.loads(path.read_text()))


def load_llama(model_dir: Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BundleError(f"no *.safetensors weights in {model_dir}; only safetensors are loaded")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(f, device=str(torch.device(device))))
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        if not cfg.tie_word_embeddings:
            raise BundleError(f"weights in {model_dir} lack lm_head.weight and config.json does not tie embeddings")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
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
    pack_weights(model)
    return model
