"""sentence-transformers model directories: the `modules.json` pipeline after the transformer
(Pooling in any of its modes, Dense, Normalize) and the prompts of
`config_sentence_transformers.json`. Read once at bundle import into bundle.json (so they are
pinned by its digest); applied at run time to the transformer's final hidden states."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from batchinf.runtime.weights import load_safetensors
from torch import Tensor

from batchinf.errors import BatchinfError, BundleError

# legacy pooling_mode_* keys concatenate in this order; a pooling_mode list, in its own
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
ACTIVATIONS = {"torch.nn.modules.activation.Tanh": torch.tanh, "torch.nn.modules.linear.Identity": lambda x: x,
               "torch.nn.modules.activation.ReLU": F.relu, "torch.nn.modules.activation.Sigmoid": torch.sigmoid,
               "torch.nn.modules.activation.GELU": F.gelu}
PROMPT_MAX_CHARS = 4096


def _kind(type_ref: str) -> str:
    # v2-v5 write "sentence_transformers.models.Pooling", v6 writes
    # "sentence_transformers.sentence_transformer.modules.pooling.Pooling"; compare class names.
    return type_ref.rsplit(".", 1)[-1] if type_ref.startswith("sentence_transformers.") else type_ref


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BundleError(f"{path} cannot be read as JSON ({e}); fix the sentence-transformers config") from e


def _pooling_modes(path: Path) -> list[str]:
    cfg = _json(path)
    if "pooling_mode" in cfg:  # sentence-transformers >= 6
        mode = cfg["pooling_mode"]
        modes = [mode] if isinstance(mode, str) else list(mode)
    else:
        modes = [_LEGACY_KEYS.get(k, k) for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
        modes = sorted(modes or ["mean"], key=lambda m: POOLING_MODES.index(m) if m in POOLING_MODES else 99)
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad or not modes:
        raise BundleError(f"{path}: pooling mode(s) {bad or modes} are not supported; use {', '.join(POOLING_MODES)}")
    if cfg.get("include_prompt", True) is False:
        raise BundleError(f"{path}: include_prompt: false (pooling that skips the prompt) is not supported")
    return modes


def _dense(root: Path, rel: str) -> dict[str, Any]:
    cfg = _json(root / rel / "config.json")
    act = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")
    if act not in ACTIVATIONS:
        raise BundleError(f"{root / rel / 'config.json'}: activation {act!r} is not supported; "
                          f"use one of {', '.join(ACTIVATIONS)}")
    weights = root / rel / "model.safetensors"
    if not weights.is_file():
        raise BundleError(f"{root / rel}: Dense weights must be model.safetensors (pickled pytorch_model.bin is refused)")
    return {"path": f"{rel}/model.safetensors", "in_features": int(cfg["in_features"]),
            "out_features": int(cfg["out_features"]), "bias": bool(cfg.get("bias", True)), "activation": act}


def read_pipeline(model_dir: Path) -> dict[str, Any]:
    """bundle.json's view of a sentence-transformers directory: pooling (str: one mode, list:
    several, concatenated), normalize, dense (layers in order) and prompts. A directory without
    modules.json pools by mean, unnormalised."""
    root = Path(model_dir)
    out: dict[str, Any] = {"pooling": "mean", "normalize": False, "dense": [], **read_prompts(root)}
    if not (root / "modules.json").is_file():
        return out
    modules = _json(root / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise BundleError(f"{root / 'modules.json'} must be a list of modules")
    kinds = [_kind(str(m.get("type"))) for m in modules]
    if not kinds or kinds[0] != "Transformer" or "Pooling" not in kinds:
        raise BundleError(f"{root / 'modules.json'}: expected a Transformer module followed by Pooling; got {kinds}")
    for m, kind in list(zip(modules, kinds))[1:]:
        rel = str(m.get("path") or "")
        if kind == "Pooling":
            modes = _pooling_modes(root / rel / "config.json")
            out["pooling"] = modes[0] if len(modes) == 1 else modes
        elif kind == "Dense":
            out["dense"].append(_dense(root, rel))
        elif kind == "Normalize":
            out["normalize"] = True
        else:
            # any other module would change the embedding: refuse rather than diverge
            raise BundleError(f"{root / 'modules.json'}: module {m.get('type')!r} is not supported "
                              "(supported after Transformer: Pooling, Dense, Normalize)")
    if kinds.index("Pooling") > min([i for i, k in enumerate(kinds) if k in ("Dense", "Normalize")] or [99]):
        raise BundleError(f"{root / 'modules.json'}: Dense/Normalize before Pooling is not supported")
    return out


def read_prompts(root: Path) -> dict[str, Any]:
    path = root / "config_sentence_transformers.json"
    if not path.is_file():
        return {}
    cfg = _json(path)
    prompts = cfg.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) and len(v) <= PROMPT_MAX_CHARS
                                                for k, v in prompts.items()):
        raise BundleError(f"{path}: prompts must map names to strings of at most {PROMPT_MAX_CHARS} characters")
    default = cfg.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise BundleError(f"{path}: default_prompt_name {default!r} is not one of its prompts")
    return {"prompts": dict(sorted(prompts.items())), "default_prompt_name": default} if prompts else {}


def load_dense(root: Path, meta: dict[str, Any], device: Any, dtype: torch.dtype) -> list[tuple[Tensor, Tensor | None, Any]]:
    layers = []
    for d in meta.get("dense") or ():
        if d.get("path") not in meta.get("files", {}):   # only files the bundle pins (names checked at load)
            raise BundleError(f"{root}/bundle.json: Dense weights {d.get('path')!r} are not a file of the bundle")
        w = load_safetensors(root / d["path"], device)
        weight, bias = w.get("linear.weight"), w.get("linear.bias")
        if weight is None or tuple(weight.shape) != (d["out_features"], d["in_features"]) or (bias is None) == d["bias"]:
            raise BundleError(f"{root / d['path']}: Dense weights do not match its config.json")
        layers.append((weight.to(dtype), bias.to(dtype) if bias is not None else None, ACTIVATIONS[d["activation"]]))
    return layers


def pool(hidden: Tensor, mask: Tensor, pooling: str | list[str]) -> Tensor:
    """[B, S, D] hidden states, [B, S] attention mask (right padding) -> [B, D * len(modes)]."""
    hidden = hidden.float()
    m = mask.to(hidden.dtype).unsqueeze(-1)                    # [B, S, 1]
    lengths = mask.sum(1)                                      # [B]
    out = []
    for mode in [pooling] if isinstance(pooling, str) else pooling:
        if mode == "cls":
            out.append(hidden[:, 0])
        elif mode == "max":
            out.append(hidden.masked_fill(m == 0, float("-inf")).max(1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            n = m.sum(1).clamp(min=1e-9)
            out.append((hidden * m).sum(1) / (n if mode == "mean" else n.sqrt()))
        elif mode == "weightedmean":
            w = m * torch.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype, device=hidden.device).view(1, -1, 1)
            out.append((hidden * w).sum(1) / w.sum(1).clamp(min=1e-9))
        elif mode == "lasttoken":
            out.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1])
        else:
            raise BatchinfError(f"unknown pooling mode {mode!r}; use one of {', '.join(POOLING_MODES)}")
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def head(vectors: Tensor, dense: list[tuple[Tensor, Tensor | None, Any]], normalize: bool) -> Tensor:
    for weight, bias, act in dense:
        vectors = act(F.linear(vectors.to(weight.dtype), weight, bias)).float()
    return F.normalize(vectors, p=2, dim=1) if normalize else vectors
