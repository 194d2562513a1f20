"""Sequence classifiers: BERT (`BertForSequenceClassification`) and XLM-RoBERTa
(`XLMRobertaForSequenceClassification`) heads over our encoder layers, loaded from safetensors.
They serve task score (cross-encoders: a query/document pair -> one logit) and task classify
(a text -> one logit per label). Parameter names equal transformers' state-dict keys, less the
`bert.` / `roberta.` prefix."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from batchinf.runtime.weights import load_safetensors
from torch import Tensor, nn

from batchinf.errors import BatchinfError, BundleError
from batchinf.runtime.empty import empty_weights
from batchinf.runtime.encoder import _TANH_GELUS, BertLayer, EncoderConfig, attention_bias, pack_encoder

FAMILIES = {"bert": "bert", "xlm-roberta": "roberta", "roberta": "roberta"}   # model_type -> weight prefix
M = TypeVar("M", bound=nn.Module)
ARCHITECTURES = ("BertForSequenceClassification", "XLMRobertaForSequenceClassification",
                 "RobertaForSequenceClassification")


@dataclass
class ClassifierConfig:
    model_type: str
    encoder: EncoderConfig
    num_labels: int
    pad_token_id: int

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ClassifierConfig:
        model_type = config.get("model_type", "")
        if model_type not in FAMILIES:
            raise BundleError(f"model_type {model_type!r} is not supported for classification; "
                              f"use one of {', '.join(FAMILIES)}")
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise BundleError("only absolute position embeddings are supported")
        act = config.get("hidden_act", "gelu")
        if act != "gelu" and act not in _TANH_GELUS:
            raise BundleError(f"hidden_act {act!r} is not supported; use gelu or {'/'.join(_TANH_GELUS)}")
        try:
            enc = EncoderConfig(**{k: config[k] for k in (
                "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings")}, type_vocab_size=config.get("type_vocab_size", 2),
                layer_norm_eps=config.get("layer_norm_eps", 1e-12), hidden_act=act)
        except KeyError as e:
            raise BundleError(f"config.json lacks a required field: {e}") from e
        labels = config.get("id2label") or {}
        num_labels = int(config.get("num_labels", len(labels) or 2))
        return cls(model_type, enc, num_labels, int(config.get("pad_token_id", 0) or 0))


class ClsEmbeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor) -> Tensor:
        x = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
             + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(x)  # [B, S, D]


class _Encoder(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class _Pooler(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d, d)


class _RobertaHead(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, n)


class SequenceClassifier(nn.Module):
    """Encoder + classification head -> logits [B, num_labels]."""

    def __init__(self, cfg: ClassifierConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.encoder.hidden_size
        self.embeddings = ClsEmbeddings(cfg.encoder)
        self.encoder = _Encoder(cfg.encoder)
        self.roberta = FAMILIES[cfg.model_type] == "roberta"
        if self.roberta:
            self.classifier: nn.Module = _RobertaHead(D, cfg.num_labels)
        else:
            self.pooler = _Pooler(D)
            self.classifier = nn.Linear(D, cfg.num_labels)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor) -> Tensor:
        S = input_ids.shape[1]
        if self.roberta:   # positions count from padding_idx + 1 over real tokens
            position_ids = torch.cumsum(attention_mask, 1) * attention_mask + self.cfg.pad_token_id
        else:
            position_ids = torch.arange(S, device=input_ids.device)[None, :].expand_as(input_ids)
        if int(position_ids.max()) >= self.cfg.encoder.max_position_embeddings:
            raise BatchinfError(f"sequence length {S} exceeds the model's positions; lower max_length")
        mask = attention_bias(attention_mask, self.embeddings.LayerNorm.weight.dtype)
        x = self.embeddings(input_ids, token_type_ids, position_ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        cls = x[:, 0]
        if self.roberta:
            return self.classifier.out_proj(torch.tanh(self.classifier.dense(cls)))
        return self.classifier(torch.tanh(self.pooler.dense(cls)))


def load_classifier(model_dir: Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> SequenceClassifier:
    cfg = ClassifierConfig.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
    prefix = FAMILIES[cfg.model_type] + "."
    state: dict[str, Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        for key, tensor in load_safetensors(f, device).items():
            key = key.removeprefix(prefix)
            if not key.endswith("position_ids") and not key.startswith("lm_head."):
                state[key] = tensor
    model = assign_weights(model_dir, lambda: SequenceClassifier(cfg), state, device, dtype)
    pack_encoder(model)
    return model


def assign_weights(model_dir: Path, build: Callable[[], M], state: dict[str, Tensor], device: str,
                   dtype: torch.dtype) -> M:
    """The module `build` makes on the meta device, given `state` as its weights (every key it
    has must be there), on `device` in `dtype`, in eval mode."""
    with empty_weights():
        model = build()
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise BundleError(f"weights in {model_dir} lack {len(missing)} key(s): {', '.join(missing[:8])}")
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        raise BundleError(f"weights in {model_dir} do not match config.json: {e}") from e
    return model.to(device=device, dtype=dtype).eval()


def logits_batch(model: SequenceClassifier, ids: list[list[int]], types: list[list[int]],
                 pad_id: int) -> tuple[np.ndarray, int]:
    """Right-padded batch -> (float32 logits [B, L], padded positions computed)."""
    if not ids or min(map(len, ids)) == 0:
        raise BatchinfError("a classifier batch needs non-empty token sequences")
    device = next(model.parameters()).device
    B, S = len(ids), max(map(len, ids))
    input_ids = torch.tensor([x + [pad_id] * (S - len(x)) for x in ids], device=device)
    type_ids = torch.tensor([t + [0] * (S - len(t)) for t in types], device=device)
    mask = torch.tensor([[1] * len(x) + [0] * (S - len(x)) for x in ids], device=device)
    with torch.inference_mode():
        out = model(input_ids, type_ids, mask).float()
    return out.cpu().numpy().astype(np.float32, copy=False), B * S


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """sigmoid | softmax | tanh | identity, in float64 then float32 (parity with torch)."""
    x = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))
    if activation == "sigmoid":
        y = torch.sigmoid(x)
    elif activation == "softmax":
        y = F.softmax(x, dim=-1)
    elif activation == "tanh":
        y = torch.tanh(x)
    elif activation == "identity":
        y = x
    else:
        raise BundleError(f"activation {activation!r} is not supported; use sigmoid, softmax, tanh or identity")
    return y.numpy()


class ClassifierRuntime:
    """A loaded sequence classifier for tasks score and classify: tokenizer (single texts and
    pairs, truncated longest-first as transformers does) + model on one device."""

    def __init__(self, root: Path, meta: dict[str, Any], device: str = "cpu",
                 dtype_override: str | None = None) -> None:
        from tokenizers import Tokenizer

        from batchinf.runtime.tokenizer import _pad_id

        self.root, self.meta, self.device, self.dtype_override = Path(root), meta, device, dtype_override
        try:
            self._tok = Tokenizer.from_file(str(self.root / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception on bad JSON
            raise BundleError(f"cannot read tokenizer {self.root / 'tokenizer.json'}: {e}") from e
        self.pad_id = _pad_id(self._tok)
        self._tok.no_padding()
        self.model: SequenceClassifier | None = None
        self._limit = 0
        self._truncate_at(int(meta["max_length"]))

    def _truncate_at(self, max_length: int) -> None:
        if max_length != self._limit:
            self._tok.no_truncation()
            self._tok.enable_truncation(max_length, stride=0, strategy="longest_first")
            self._limit = max_length

    def encode(self, inputs: list[str] | list[tuple[str, str]],
               max_length: int | None = None) -> list[tuple[list[int], list[int], bool]]:
        """Texts or (query, document) pairs -> (ids, token type ids, truncated) each."""
        self._truncate_at(max_length or int(self.meta["max_length"]))
        out = [(e.ids, e.type_ids, len(e.overflowing) > 0) for e in self._tok.encode_batch(inputs)]
        self._truncate_at(int(self.meta["max_length"]))
        return out

    def encode_fixture(self, text: str) -> list[int]:
        return self.encode([text])[0][0]

    def load_model(self) -> None:
        dtype = self.dtype_override or self.meta.get("dtype", "float32")
        if self.device == "cpu":
            dtype = "float32"
        self.model = load_classifier(self.root, device=self.device, dtype=getattr(torch, dtype))

    def logits(self, ids: list[list[int]], types: list[list[int]]) -> tuple[np.ndarray, int]:
        if self.model is None:
            self.load_model()
        assert self.model is not None
        return logits_batch(self.model, ids, types, self.pad_id)


def verify_logit_fixtures(runtime: ClassifierRuntime) -> None:
    """Each fixture's recorded logits must come back within 1e-4 in float32 (1e-2 otherwise)."""
    fx = runtime.meta["fixtures"]
    got, _ = runtime.logits([f["input_ids"] for f in fx], [f["type_ids"] for f in fx])
    assert runtime.model is not None
    compare_logits(got, fx, next(runtime.model.parameters()).dtype, runtime.root)


def compare_logits(got: np.ndarray, fixtures: list[dict[str, Any]], dtype: torch.dtype, root: Path) -> None:
    """BundleError unless `got` is within 1e-4 of the fixtures' recorded logits (1e-2 below float32)."""
    want = np.asarray([f["logits"] for f in fixtures], dtype=np.float32)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    err = np.abs(got - want).max(axis=1) / np.maximum(1.0, np.abs(want).max(axis=1))
    bad = np.flatnonzero(err > tol)
    if bad.size:
        i = int(bad[0])
        raise BundleError(f"model fixture {i} of bundle {root} gives logits {err[i]:.2e} away from its "
                          "recorded ones: weights or runtime changed; restore the bundle or re-import it")
