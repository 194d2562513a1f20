"""The transformers fallback: an embedding model whose architecture has no native implementation
(e.g. ModernBERT, MPNet, DistilBERT) runs through transformers' own `AutoModel` class, under the
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


def fallback_architecture(config: dict[str, Any], src: Path) -> str | None:
    """The transformers class an embedding model without a native implementation would run
    through, or None when it is not one (a decoder for generation is not: generate needs a native
    family). Refuses remote code before anything is imported."""
    archs = [a for a in config.get("architectures") or () if isinstance(a, str)]
    # a bare encoder (ModernBertModel, MPNetModel), not a head (GPT2LMHeadModel, *ForCausalLM)
    embed_like = (src / "modules.json").is_file() or any(
        a.endswith("Model") and "LMHead" not in a and "For" not in a for a in archs)
    if not embed_like:
        return None
    refuse_remote_code(src, config)
    transformers = transformers_module()
    mapping = transformers.AutoConfig.for_model  # raises ValueError for an unknown model_type
    try:
        mapping(str(config.get("model_type")))
    except (ValueError, KeyError):
        raise BundleError(f"{src}: model_type {config.get('model_type')!r} is unknown to transformers "
                          f"{transformers.__version__}; upgrade it or use a supported model") from None
    return next((a for a in archs if hasattr(transformers, a)), "AutoModel")


def implementation() -> dict[str, str]:
    return {"name": IMPLEMENTATION, "version": transformers_module().__version__}


class TransformersEncoder(nn.Module):
    """transformers' AutoModel as an encoder: (input_ids, attention_mask) -> last hidden states."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def load_transformers_encoder(model_dir: Path, device: str = "cpu", dtype: Any = None) -> TransformersEncoder:
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    refuse_remote_code(model_dir, config)
    transformers = transformers_module()
    try:
        model = transformers.AutoModel.from_pretrained(model_dir, trust_remote_code=False, use_safetensors=True,
                                                       local_files_only=True)
    except (OSError, ValueError) as e:
        raise BundleError(f"{model_dir}: transformers cannot load this model ({e})") from e
    return TransformersEncoder(model.to(device=device, dtype=dtype).eval())
