"""ModernBERT (native): pre-norm encoder with bias-free LayerNorms, fused QKV, rotary positions
with a global and a local base, bidirectional sliding-window attention on the layers config.json
marks `sliding_attention` (|q - k| <= local_attention / 2) and a GeGLU MLP. Parameter names equal
transformers' ModernBertModel state-dict keys (a `model.` prefix and MLM head are dropped)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from batchinf.runtime.weights import load_safetensors
from torch import Tensor, nn

from batchinf.errors import BatchinfError, BundleError
from batchinf.runtime.decoder_config import FULL, SLIDING
from batchinf.runtime.empty import empty_weights

_ACTS = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}


@dataclass
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    local_attention: int
    global_theta: float
    local_theta: float
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    gelu: str = "none"

    @classmethod
    def from_hf(cls, c: dict[str, Any]) -> ModernBertConfig:
        act = c.get("hidden_activation", "gelu")
        if act not in _ACTS:
            raise BundleError(f"hidden_activation {act!r} is not supported for ModernBERT; use {', '.join(_ACTS)}")
        try:
            n = int(c["num_hidden_layers"])
            every = int(c.get("global_attn_every_n_layers", 3))
            types = tuple(c.get("layer_types") or (SLIDING if i % every else FULL for i in range(n)))
            rope = c.get("rope_parameters") or {}
            return cls(
                vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
                intermediate_size=int(c["intermediate_size"]), num_hidden_layers=n,
                num_attention_heads=int(c["num_attention_heads"]),
                max_position_embeddings=int(c.get("max_position_embeddings", 8192)), layer_types=types,
                local_attention=int(c.get("local_attention", 128)),
                global_theta=float((rope.get(FULL) or {}).get("rope_theta", c.get("global_rope_theta", 160000.0))),
                local_theta=float((rope.get(SLIDING) or {}).get("rope_theta", c.get("local_rope_theta", 10000.0))),
                norm_eps=float(c.get("norm_eps", 1e-5)), norm_bias=bool(c.get("norm_bias", False)),
                attention_bias=bool(c.get("attention_bias", False)), mlp_bias=bool(c.get("mlp_bias", False)),
                gelu=_ACTS[act])
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"config.json lacks a required ModernBERT field or has a bad value: {e}") from e


def _norm(cfg: ModernBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.norm_bias)


class Embeddings(nn.Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = _norm(cfg)


class Attention(nn.Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.H, self.Dh = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.attention_bias)
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        from batchinf.runtime.llama import rotate

        B, S, D = x.shape
        q, k, v = self.Wqkv(x).view(B, S, 3, self.H, self.Dh).unbind(2)           # [B, S, H, Dh] each
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                           # [B, H, S, Dh]
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, attn_mask=mask)
        return self.Wo(y.transpose(1, 2).reshape(B, S, D))


class MLP(nn.Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.approximate = cfg.gelu

    def forward(self, x: Tensor) -> Tensor:
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(F.gelu(inp, approximate=self.approximate) * gate)


class Layer(nn.Module):
    def __init__(self, cfg: ModernBertConfig, i: int) -> None:
        super().__init__()
        self.attn_norm = _norm(cfg) if i else nn.Identity()
        self.attn = Attention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = MLP(cfg)
        self.local = cfg.layer_types[i] == SLIDING


class ModernBertEncoder(nn.Module):
    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = _norm(cfg)

    def _rope(self, S: int, theta: float, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        Dh = self.config.hidden_size // self.config.num_attention_heads
        inv = 1.0 / (theta ** (torch.arange(0, Dh, 2, dtype=torch.int64, device=device).float() / Dh))
        freqs = torch.arange(S, device=device).float()[:, None] * inv                  # [S, Dh/2], fp32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Right-padded input_ids [B, S], attention_mask [B, S] -> hidden states [B, S, D]."""
        B, S = input_ids.shape
        cfg = self.config
        if S > cfg.max_position_embeddings:
            raise BatchinfError(f"sequence length {S} exceeds max_position_embeddings {cfg.max_position_embeddings}; "
                                "lower the tokenizer max_length")
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        keys = attention_mask.bool()[:, None, None, :]                                 # [B, 1, 1, S]
        pos = torch.arange(S, device=x.device)
        near = (pos[None, :] - pos[:, None]).abs() <= cfg.local_attention // 2          # [S, S]
        masks = {False: keys, True: keys & near}
        ropes = {False: self._rope(S, cfg.global_theta, x.device, x.dtype),
                 True: self._rope(S, cfg.local_theta, x.device, x.dtype)}
        for layer in self.layers:
            cos, sin = ropes[layer.local]
            x = x + layer.attn(layer.attn_norm(x), cos, sin, masks[layer.local])
            x = x + layer.mlp(layer.mlp_norm(x))
        return self.final_norm(x)


def load_modernbert(model_dir: Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> ModernBertEncoder:
    model_dir = Path(model_dir)
    cfg = ModernBertConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BundleError(f"no *.safetensors weights in {model_dir}; only safetensors are loaded")
    state: dict[str, Tensor] = {}
    for f in files:
        for key, t in load_safetensors(f, device).items():
            state[key.removeprefix("model.")] = t
    with empty_weights():
        model = ModernBertEncoder(cfg)
    want = set(model.state_dict())
    missing = sorted(want - set(state))
    if missing:
        raise BundleError(f"weights in {model_dir} lack {len(missing)} key(s): {', '.join(missing[:5])}")
    try:
        model.load_state_dict({k: state[k] for k in want}, strict=True, assign=True)
    except RuntimeError as e:
        raise BundleError(f"weights in {model_dir} do not match config.json: {e}") from e
    return model.to(device=device, dtype=dtype).eval()
