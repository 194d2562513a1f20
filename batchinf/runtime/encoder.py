"""A BERT-family text encoder (BERT, RoBERTa, XLM-RoBERTa), its safetensors loader, and batched
embedding through the sentence-transformers pipeline of runtime/st_modules.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from batchinf.runtime.weights import load_safetensors
from torch import Tensor, nn

from batchinf.config import settings
from batchinf.errors import BatchinfError, BundleError
from batchinf.runtime.empty import empty_weights

_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# Checkpoint keys the encoder has no use for.
_IGNORED_PREFIXES = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids", "embeddings.token_type_ids")
ENCODER_TYPES = ("bert", "xlm-roberta", "roberta")


@dataclass
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_offset: int = 0    # (XLM-)RoBERTa: positions start at padding_idx + 1

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "EncoderConfig":
        model_type = config.get("model_type", "bert")
        if model_type not in ENCODER_TYPES:
            raise BundleError(f"model_type {model_type!r} is not supported; use one of {', '.join(ENCODER_TYPES)}")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise BundleError("only absolute position embeddings are supported")
        act = config.get("hidden_act", "gelu")
        if act != "gelu" and act not in _TANH_GELUS:
            raise BundleError(f"hidden_act {act!r} is not supported; use gelu or {'/'.join(_TANH_GELUS)}")
        try:
            cfg = cls(**{f.name: config[f.name] for f in fields(cls) if f.name in config})
            if model_type != "bert":
                cfg.position_offset = int(config.get("pad_token_id", 1) or 0) + 1
            return cfg
        except (TypeError, ValueError) as e:
            raise BundleError(f"config.json lacks a required field: {e}") from e


def _identity(*tensors: Tensor) -> tuple[int, ...]:
    """Changes whenever one of the tensors is replaced, moved or written (inference tensors, made
    under inference_mode, keep no version counter)."""
    return tuple(n for t in tensors for n in (t.data_ptr(), 0 if t.is_inference() else t._version))


class Prepacked:
    """A float32 CPU projection through oneDNN with its weight prepacked once, optionally with the
    GELU or the residual add fused into the GEMM: 1.1-1.5x torch's F.linear per GEMM on one AVX2
    thread (docs/performance). Stale once its weight is replaced, moved or written: the
    callers then take the plain path."""

    def __init__(self, weight: Tensor, bias: Tensor) -> None:
        self.identity = _identity(weight, bias)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = bias.detach()

    def fresh(self, weight: Tensor, bias: Tensor) -> bool:
        return self.identity == _identity(weight, bias)

    def __call__(self, x: Tensor, post_op: str = "none", algorithm: str = "") -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, post_op, [], algorithm)

    def add(self, x: Tensor, other: Tensor) -> Tensor:
        """linear(x) + other, in one pass."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "add")


class SelfAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        if cfg.hidden_size % cfg.num_attention_heads:
            raise BundleError("hidden_size must be divisible by num_attention_heads")
        self.n_head = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self._fused: tuple[tuple[int, ...], Tensor, Tensor] | None = None
        self.int8: nn.Module | None = None     # runtime/int8.py: the fused projection in int8
        self.packed: Prepacked | None = None   # pack_encoder: the fused projection prepacked

    def qkv_weights(self) -> tuple[Tensor, Tensor]:
        """Query, key and value stacked into one [3D, D] projection: one GEMM and one output
        allocation instead of three (rebuilt whenever the weights are replaced, moved or written)."""
        projs = (self.query, self.key, self.value)
        key = _identity(*(t for p in projs for t in (p.weight, p.bias)))
        if self._fused is None or self._fused[0] != key:
            with torch.no_grad():
                w = torch.cat([p.weight for p in projs]).detach()
                b = torch.cat([p.bias for p in projs]).detach()
            self._fused = (key, w, b)
        return self._fused[1], self._fused[2]

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        B, S, D = x.shape
        if self.int8 is not None:
            qkv = self.int8(x)
        else:
            w, b = self.qkv_weights()
            qkv = self.packed(x) if self.packed is not None and self.packed.fresh(w, b) else F.linear(x, w, b)
        # [B, S, 3, H, Dh] -> q, k, v views [B, H, S, Dh]
        qkv = qkv.view(B, S, 3, self.n_head, D // self.n_head)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # mask: [B, 1, 1, S]
        return y.transpose(1, 2).reshape(B, S, D)


class ResidualOutput(nn.Module):
    """dense -> + residual -> LayerNorm (BERT is post-LN)."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)
        self.int8: nn.Module | None = None     # runtime/int8.py: dense in int8
        self.packed: Prepacked | None = None   # pack_encoder: dense prepacked, the residual add fused

    def forward(self, h: Tensor, residual: Tensor) -> Tensor:
        if self.int8 is not None:
            return self.LayerNorm(self.int8(h, residual))
        if self.packed is not None and self.packed.fresh(self.dense.weight, self.dense.bias):
            return self.LayerNorm(self.packed.add(h, residual))
        # residual + bias, then the GEMM accumulates into it: one pass and one allocation fewer
        # than dense(h) + residual
        y = (residual + self.dense.bias).view(-1, residual.shape[-1])
        y.addmm_(h.reshape(-1, h.shape[-1]), self.dense.weight.t())
        return self.LayerNorm(y.view(residual.shape))


class Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = ResidualOutput(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.approximate = "tanh" if cfg.hidden_act in _TANH_GELUS else "none"
        self.packed: Prepacked | None = None   # pack_encoder: dense prepacked, GELU fused

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is not None and self.packed.fresh(self.dense.weight, self.dense.bias):
            return self.packed(x, "gelu", self.approximate)
        h = self.dense(x)
        if torch.is_inference_mode_enabled():   # in place: one [B, S, I] allocation fewer
            return torch.ops.aten.gelu_(h, approximate=self.approximate)
        return F.gelu(h, approximate=self.approximate)  # [B, S, I]


class BertLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = ResidualOutput(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: Tensor) -> Tensor:
        S = input_ids.shape[1]
        # right padding: real tokens sit at 0..len-1 (padding's positions are never attended to)
        pos = torch.arange(S, device=input_ids.device) + self.config.position_offset
        # Single-segment input: token type is always 0.
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)  # [B, S, D]


class Encoder(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertEncoder(nn.Module):
    """Parameter names equal HF BertModel's state-dict keys (less `pooler.*`)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        S = input_ids.shape[1]
        if S + self.config.position_offset > self.config.max_position_embeddings:
            raise BatchinfError(
                f"sequence length {S} exceeds the {self.config.max_position_embeddings} position embeddings "
                f"(less an offset of {self.config.position_offset}); lower the tokenizer max_length"
            )
        mask = attention_bias(attention_mask, self.embeddings.LayerNorm.weight.dtype)
        x = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x  # [B, S, D]


def attention_bias(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, S] 1/0 mask -> additive [B, 1, 1, S] bias (0 = attend, -inf = padding), built once per
    batch: a boolean mask would be converted to this by every layer's attention again."""
    bias = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill_(attention_mask == 0, float("-inf"))[:, None, None, :]


def load_encoder(
    model_dir: Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> BertEncoder:
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise BundleError(f"{config_path} not found; a model directory needs an HF config.json")
    cfg = EncoderConfig.from_hf(json.loads(config_path.read_text()))

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise BundleError(
            f"no *.safetensors weights in {model_dir}; only safetensors are loaded (pickle files are refused)"
        )
    state: dict[str, Tensor] = {}
    for f in files:
        for key, tensor in load_safetensors(f, device).items():
            key = key.removeprefix("bert.").removeprefix("roberta.")
            if not key.startswith(_IGNORED_PREFIXES):
                state[key] = tensor

    with empty_weights():
        model = BertEncoder(cfg)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise BundleError(f"weights in {model_dir} lack {len(missing)} key(s): {', '.join(missing)}")
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shape mismatch against config.json
        raise BundleError(f"weights in {model_dir} do not match config.json: {e}") from e
    model = model.to(device=device, dtype=dtype).eval()
    pack_encoder(model)
    return model


def pack_encoder(model: nn.Module) -> bool:
    """Give every BERT layer of a CPU float32 model oneDNN-prepacked projections (`Prepacked`), if
    this torch build has the op and a packed product equals the plain one (checked per weight
    shape) -> whether it packed. One more copy of the projections in memory;
    BATCHINF_PACK_WEIGHTS=0 turns it off."""
    layers = [m for m in model.modules() if isinstance(m, BertLayer)]
    weights = [t for m in layers for t in m.parameters()]
    if (not settings().pack_weights or not layers or not torch.backends.mkldnn.is_available()
            or not hasattr(torch.ops.mkldnn, "_linear_pointwise")
            or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in weights)):
        return False
    projections: list[tuple[nn.Module, Tensor, Tensor]] = []     # (module that owns it, weight, bias)
    for layer in layers:
        projections.append((layer.attention.self, *layer.attention.self.qkv_weights()))
        projections += [(m, m.dense.weight, m.dense.bias)
                        for m in (layer.intermediate, layer.attention.output, layer.output)]
    gen = torch.Generator().manual_seed(0)
    checked: set[tuple[int, ...]] = set()
    with torch.no_grad():
        for module, w, b in projections:
            module.packed = Prepacked(w, b)
            if tuple(w.shape) in checked:
                continue
            x = torch.randn(2, 3, w.shape[1], generator=gen)
            if not torch.allclose(module.packed(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4):
                for m, _, _ in projections:
                    m.packed = None
                return False
            checked.add(tuple(w.shape))
    return True


def embed_batch(
    model: nn.Module, batch: list[list[int]], pad_id: int, pooling: str | list[str], normalize: bool,
    dense: list[Any] = (),  # type: ignore[assignment]
) -> tuple[np.ndarray, int]:
    """Token-id lists -> (float32 [B, D'], padded positions computed) through `model` (any module
    mapping input_ids and attention_mask to hidden states [B, S, D]) and the pooling head."""
    from batchinf.runtime.st_modules import head, pool

    device = next(model.parameters()).device
    if not batch or min(map(len, batch)) == 0:
        # An all-padding row has no key to attend to and would pool to NaN.
        raise BatchinfError("embed_batch needs a non-empty batch of non-empty token sequences")
    B, S = len(batch), max(map(len, batch))
    input_ids = torch.tensor([ids + [pad_id] * (S - len(ids)) for ids in batch], device=device)  # [B, S]
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (S - len(ids)) for ids in batch], device=device)
    with torch.inference_mode():
        hidden = model(input_ids, attention_mask)  # [B, S, D]
        out = head(pool(hidden, attention_mask, pooling), list(dense), normalize)  # [B, D']
    return out.cpu().numpy().astype(np.float32, copy=False), B * S


def read_pooling_config(model_dir: Path) -> tuple[str | list[str], bool]:
    """(pooling, normalize) of a sentence-transformers directory (see st_modules.read_pipeline)."""
    from batchinf.runtime.st_modules import read_pipeline

    pipeline = read_pipeline(model_dir)
    return pipeline["pooling"], pipeline["normalize"]


def sentence_transformers_max_length(model_dir: Path) -> int | None:
    path = Path(model_dir) / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_seq_length")
    return int(value) if value is not None else None
