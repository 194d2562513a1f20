"""Bundle import for image classifiers (task classify_image): bundle.json with labels,
activation, the preprocessor config pinned with the weights (its digest among the files, its
resolved steps in the meta), and fixtures: deterministic images whose preprocessed pixels
(digest) and logits are recorded with our own runtime, so drift in Pillow or the model shows at load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from batchinf.errors import BundleError


def build_image_meta(src: Path, files: list[str], *, task: str, dtype: str) -> dict[str, Any]:
    from dataclasses import asdict

    from batchinf.digests import sha256_file
    from batchinf.runtime.bundle import BUNDLE_FORMAT
    from batchinf.runtime.images import fixture_images, pixels_digest, read_preprocessor
    from batchinf.runtime.vit import ImageRuntime, ViTConfig

    config = json.loads((src / "config.json").read_text())
    cfg = ViTConfig.from_hf(config)
    pre = read_preprocessor(src)
    size = pre.output_size()
    if size != (cfg.image_size, cfg.image_size):
        raise BundleError(f"{src}: preprocessor_config.json gives images of {size or 'varying size'}; this ViT "
                          f"takes {cfg.image_size}x{cfg.image_size} (set size or crop_size to match)")
    if not any(f.endswith(".safetensors") for f in files):
        raise BundleError(f"{src}: a bundle needs weights as *.safetensors")
    id2label = config.get("id2label") or {}
    labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(cfg.num_labels)]  # type: ignore[call-overload]
    multi = config.get("problem_type") == "multi_label_classification"
    meta: dict[str, Any] = {
        "format": BUNDLE_FORMAT, "task": task, "family": "vit", "dtype": dtype, "max_length": 0,
        "image_size": cfg.image_size, "preprocessor": asdict(pre), "labels": labels,
        "activation": "sigmoid" if multi else "softmax",
        "problem_type": config.get("problem_type") or "single_label_classification",
        "files": {f: sha256_file(src / f) for f in files},
    }
    runtime = ImageRuntime(src, {**meta, "fixtures": []}, device="cpu", dtype_override="float32")
    pixels = np.stack([pre.to_pixels(img) for img in fixture_images()])
    logits = runtime.logits(pixels)
    meta["fixtures"] = [{"image": i, "pixels_sha256": pixels_digest(p), "logits": [round(float(v), 7) for v in row]}
                        for i, (p, row) in enumerate(zip(pixels, logits))]
    return meta


def fixture_pixels(runtime: Any) -> np.ndarray:
    from batchinf.runtime.images import fixture_images

    return np.stack([runtime.preprocessor.to_pixels(img) for img in fixture_images()])


def verify_pixel_fixtures(runtime: Any) -> None:
    """The fixture images must preprocess to the very pixels recorded at import."""
    from batchinf.runtime.images import pixels_digest

    for fx, px in zip(runtime.meta["fixtures"], fixture_pixels(runtime)):
        if pixels_digest(px) != fx["pixels_sha256"]:
            raise BundleError(f"image preprocessing drift in bundle {runtime.root}: fixture image {fx['image']} "
                              "preprocesses to other pixels than at import (Pillow changed?); pin the Pillow "
                              "version the bundle was imported with, or re-import the bundle")


def verify_image_logits(runtime: Any) -> None:
    """Each fixture's recorded logits must come back within 1e-4 in float32 (1e-2 otherwise)."""
    from batchinf.runtime.classifier import compare_logits

    got = runtime.logits(fixture_pixels(runtime))
    compare_logits(got, runtime.meta["fixtures"], next(runtime.model.parameters()).dtype, runtime.root)
