"""Bundle import for sequence classifiers (tasks score and classify): bundle.json with labels,
activation, max length, file digests and logit fixtures computed with our own runtime."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchinf.errors import BundleError

ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh", "Softmax": "softmax"}


def is_sequence_classifier(config: dict[str, Any]) -> bool:
    from batchinf.runtime.classifier import ARCHITECTURES

    return any(a in ARCHITECTURES for a in config.get("architectures") or ())


def is_cross_encoder(config: dict[str, Any]) -> bool:
    """A sentence-transformers CrossEncoder (its config names an activation) or a one-logit head."""
    st = config.get("sentence_transformers") or {}
    return ("activation_fn" in st or config.get("sbert_ce_default_activation_function") is not None
            or int(config.get("num_labels", len(config.get("id2label") or {}) or 2)) == 1)


def cross_encoder_activation(config: dict[str, Any], num_labels: int) -> str:
    """The activation CrossEncoder.predict applies, from its config (else sigmoid for one label)."""
    path = (config.get("sentence_transformers") or {}).get("activation_fn") \
        or config.get("sbert_ce_default_activation_function")
    if path:
        name = str(path).rsplit(".", 1)[-1]
        if name not in ACTIVATIONS:
            raise BundleError(f"activation {path!r} of this cross-encoder is not supported; supported: "
                              f"{', '.join(ACTIVATIONS)}")
        return ACTIVATIONS[name]
    return "sigmoid" if num_labels == 1 else "identity"


def build_classifier_meta(src: Path, files: list[str], *, task: str, max_length: int | None, dtype: str,
                          fixture_inputs: list[Any]) -> dict[str, Any]:
    from batchinf.digests import sha256_file
    from batchinf.runtime.bundle import BUNDLE_FORMAT
    from batchinf.runtime.classifier import ClassifierConfig, ClassifierRuntime

    config = json.loads((src / "config.json").read_text())
    cfg = ClassifierConfig.from_hf(config)
    limit = cfg.encoder.max_position_embeddings - (cfg.pad_token_id + 1 if cfg.model_type != "bert" else 0)
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text()) if (src / "tokenizer_config.json").is_file() \
        else {}
    default = min(limit, int(tok_cfg.get("model_max_length", limit) or limit))
    max_length = max_length or int(config.get("max_length") or default)
    if max_length > limit:
        raise BundleError(f"max length {max_length} exceeds the model's {limit} positions")
    id2label = config.get("id2label") or {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
    labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(cfg.num_labels)]  # type: ignore[call-overload]
    if task == "score":
        activation = cross_encoder_activation(config, cfg.num_labels)
    else:
        multi = config.get("problem_type") == "multi_label_classification"
        activation = "sigmoid" if multi else "softmax"
    meta: dict[str, Any] = {
        "format": BUNDLE_FORMAT, "task": task, "family": cfg.model_type, "dtype": dtype,
        "max_length": max_length, "labels": labels, "activation": activation,
        "problem_type": config.get("problem_type") or "single_label_classification",
        "files": {f: sha256_file(src / f) for f in files},
    }
    runtime = ClassifierRuntime(src, {**meta, "fixtures": []}, device="cpu", dtype_override="float32")
    encoded = runtime.encode(fixture_inputs)
    logits, _ = runtime.logits([e[0] for e in encoded], [e[1] for e in encoded])
    meta["fixtures"] = [{"text": x if isinstance(x, str) else x[0], "token_ids": runtime.encode_fixture(
                         x if isinstance(x, str) else x[0]), "input_ids": e[0], "type_ids": e[1],
                         "logits": [round(float(v), 7) for v in row]}
                        for x, e, row in zip(fixture_inputs, encoded, logits)]
    return meta
