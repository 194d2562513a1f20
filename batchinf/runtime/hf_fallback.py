"""The transformers fallback: an embedding model whose architecture has no native implementation
(e.g. MPNet, DistilBERT) runs through transformers' own `AutoModel` class (a causal LM for
generation through `AutoModelForCausalLM`, see `hf_decoder.py`), under the
same bundle contract (file digests, fixtures, pinned dtype) and the same token-budget batching
and sentence-transformers pipeline as a native one. Safetensors only, never remote code
(`trust_remote_code=False` always; a model that needs it is refused at import). transformers is
an optional dependency, imported only here and only when such a bundle is imported or loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from batchinf.errors import BundleError

IMPLEMENTATION = "transformers"
_REMOTE_FILES = (".py",)


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise BundleError("this model's architecture has no native batchinf implementation and runs through "
                          "transformers, which is not installed: `pip install transformers`") from e
    return transformers


def refuse_remote_code(src: Path, config: dict[str, Any]) -> None:
    """A model that needs code from its own directory (auto_map, *.py) is refused, by name."""
    tok_cfg = src / "tokenizer_config.json"
    maps = [p.name for p, c in ((src / "config.json", config),
                                (tok_cfg, json.loads(tok_cfg.read_text()) if tok_cfg.is_file() else {}))
            if isinstance(c, dict) and c.get("auto_map")]
    code = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.suffix in _REMOTE_FILES)
    if maps or code:
        raise BundleError(f"{src}: the model needs remote code ({', '.join(maps + code)} "
                          f"{'declare auto_map' if maps else 'ship Python code'}); batchinf never runs code from a "
                          "model directory (trust_remote_code is always False). Use a model whose architecture "
                          "transformers ships, or one batchinf runs natively")


def _is_causal_lm(arch: str) -> bool:
    return arch.endswith(("ForCausalLM", "LMHeadModel"))


def fallback_architecture(config: dict[str, Any], src: Path) -> str | None:
    """The transformers class an embedding model without a native implementation would run
    through, or None when it is not one (a causal LM is not: see `causal_lm_architecture`).
    Refuses remote code before anything is imported."""
    archs = [a for a in config.get("architectures") or () if isinstance(a, str)]
    # a bare encoder (ModernBertModel, MPNetModel), not a head (GPT2LMHeadModel, *ForCausalLM)
    embed_like = (src / "modules.json").is_file() or any(
        a.endswith("Model") and "LMHead" not in a and "For" not in a for a in archs)
    return _known_class(config, src, archs, "AutoModel") if embed_like else None


def causal_lm_architecture(config: dict[str, Any], src: Path) -> str | None:
    """The transformers class a generation model without a native decoder runs through
    (GPT2LMHeadModel, GPTNeoXForCausalLM, ...), or None when config.json names no causal LM."""
    archs = [a for a in config.get("architectures") or () if isinstance(a, str) and _is_causal_lm(a)]
    return _known_class(config, src, archs, "AutoModelForCausalLM") if archs else None


def _known_class(config: dict[str, Any], src: Path, archs: list[str], auto: str) -> str:
    refuse_remote_code(src, config)
    transformers = transformers_module()
    try:
        transformers.AutoConfig.for_model(str(config.get("model_type")))   # ValueError for an unknown type
    except (ValueError, KeyError):
        raise BundleError(f"{src}: model_type {config.get('model_type')!r} is unknown to transformers "
                          f"{transformers.__version__}; upgrade it or use a supported model") from None
    return next((a for a in archs if hasattr(transformers, a)), auto)


def implementation() -> dict[str, str]:
    return {"name": IMPLEMENTATION, "version": transformers_module().__version__}


class TransformersEncoder(nn.Module):
    """transformers' AutoModel as an encoder: (input_ids, attention_mask) -> last hidden states."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def from_pretrained(model_dir: Path, auto_class: str, device: str, dtype: Any) -> nn.Module:
    """transformers' `auto_class` from a model directory: safetensors only, never remote code."""
    model_dir = Path(model_dir)
    refuse_remote_code(model_dir, json.loads((model_dir / "config.json").read_text()))
    try:
        model = getattr(transformers_module(), auto_class).from_pretrained(
            model_dir, trust_remote_code=False, use_safetensors=True, local_files_only=True)
    except (OSError, ValueError) as e:
        raise BundleError(f"{model_dir}: transformers cannot load this model ({e})") from e
    return model.to(device=device, dtype=dtype).eval()


def load_transformers_encoder(model_dir: Path, device: str = "cpu", dtype: Any = None) -> TransformersEncoder:
    return TransformersEncoder(from_pretrained(model_dir, "AutoModel", device, dtype))
