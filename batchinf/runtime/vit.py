"""A ViT image classifier (`ViTForImageClassification`), its safetensors loader, and the runtime
of task classify_image: the bundle's preprocessor + model on one device. Parameter names equal
transformers' state-dict keys, less the `vit.` prefix. Images must have the config's image_size
(no position interpolation), which the preprocessor guarantees."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from batchinf.runtime.weights import load_safetensors
from torch import Tensor, nn

from batchinf.errors import BatchinfError, BundleError
from batchinf.runtime.classifier import assign_weights
from batchinf.runtime.encoder import _TANH_GELUS, EncoderConfig, SelfAttention
from batchinf.runtime.images import Preprocessor, read_preprocessor

ARCHITECTURES = ("ViTForImageClassification",)


@dataclass
class ViTConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    image_size: int
    patch_size: int
    num_channels: int
    num_labels: int
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ViTConfig:
        if config.get("model_type") != "vit":
            raise BundleError(f"model_type {config.get('model_type')!r} is not supported for image "
                              "classification; use a ViT (model_type vit)")
        act = config.get("hidden_act", "gelu")
        if act != "gelu" and act not in _TANH_GELUS:
            raise BundleError(f"hidden_act {act!r} is not supported; use gelu or {'/'.join(_TANH_GELUS)}")
        if not config.get("qkv_bias", True):
            raise BundleError("ViT models without query/key/value biases (qkv_bias: false) are not supported")
        labels = config.get("id2label") or {}
        try:
            return cls(**{k: int(config[k]) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                       "intermediate_size", "image_size", "patch_size")},
                       num_channels=int(config.get("num_channels", 3)),
                       num_labels=int(config.get("num_labels", len(labels) or 2)),
                       layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)), hidden_act=act)
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"config.json lacks a required field or has a bad value: {e}") from e

    def encoder(self) -> EncoderConfig:
        return EncoderConfig(0, self.hidden_size, self.num_hidden_layers, self.num_attention_heads,
                             self.intermediate_size, 0, 0, self.layer_norm_eps, self.hidden_act)


class _Patches(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.projection = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)


class _Embeddings(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        n = (cfg.image_size // cfg.patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden_size))
        self.position_embeddings = nn.Parameter(torch.zeros(1, n + 1, cfg.hidden_size))
        self.patch_embeddings = _Patches(cfg)

    def forward(self, pixels: Tensor) -> Tensor:
        x = self.patch_embeddings.projection(pixels).flatten(2).transpose(1, 2)   # [B, N, D]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)     # [B, N+1, D]
        return x + self.position_embeddings


class _Dense(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)


class _Attention(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(cfg.encoder())
        self.output = _Dense(cfg.hidden_size, cfg.hidden_size)


class ViTLayer(nn.Module):
    """Pre-LN transformer block: x + attn(LN(x)), then + MLP(LN(x))."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        D, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.layernorm_before = nn.LayerNorm(D, eps=eps)
        self.attention = _Attention(cfg)
        self.layernorm_after = nn.LayerNorm(D, eps=eps)
        self.intermediate = _Dense(D, cfg.intermediate_size)
        self.output = _Dense(cfg.intermediate_size, D)
        self.approximate = "tanh" if cfg.hidden_act in _TANH_GELUS else "none"

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention.output.dense(self.attention.attention(self.layernorm_before(x), None))
        h = F.gelu(self.intermediate.dense(self.layernorm_after(x)), approximate=self.approximate)
        return x + self.output.dense(h)


class ViTClassifier(nn.Module):
    """pixels [B, C, H, W] -> logits [B, num_labels] (classifier on the CLS token)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = _Embeddings(cfg)
        self.encoder = nn.Module()    # state-dict keys encoder.layer.N.*
        self.encoder.layer = nn.ModuleList(ViTLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, pixels: Tensor) -> Tensor:
        size = self.cfg.image_size
        if tuple(pixels.shape[1:]) != (self.cfg.num_channels, size, size):
            raise BatchinfError(f"images of shape {tuple(pixels.shape[1:])} do not fit this ViT "
                                f"({self.cfg.num_channels}x{size}x{size})")
        x = self.embeddings(pixels)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.classifier(self.layernorm(x)[:, 0])


def load_vit(model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> ViTClassifier:
    cfg = ViTConfig.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
    state: dict[str, Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        for key, tensor in load_safetensors(f, device).items():
            if not key.startswith("vit.pooler."):
                state[key.removeprefix("vit.")] = tensor
    return assign_weights(model_dir, lambda: ViTClassifier(cfg), state, device, dtype)


class ImageRuntime:
    """A loaded image classifier: the bundle's preprocessor and (once loaded) its model."""

    def __init__(self, root: Path, meta: dict[str, Any], device: str = "cpu",
                 dtype_override: str | None = None) -> None:
        self.root, self.meta, self.device, self.dtype_override = Path(root), meta, device, dtype_override
        self.preprocessor: Preprocessor = read_preprocessor(self.root)
        self.model: ViTClassifier | None = None

    def load_model(self) -> None:
        dtype = "float32" if self.device == "cpu" else (self.dtype_override or self.meta.get("dtype", "float32"))
        self.model = load_vit(self.root, device=self.device, dtype=getattr(torch, dtype))

    def logits(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 [B, H, W, 3] preprocessed-size images -> float32 logits [B, num_labels]."""
        if self.model is None:
            self.load_model()
        assert self.model is not None
        p = next(self.model.parameters())
        x = torch.from_numpy(self.preprocessor.normalize(pixels)).to(device=p.device, dtype=p.dtype)
        with torch.inference_mode():
            return self.model(x).float().cpu().numpy()
