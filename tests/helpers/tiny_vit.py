"""A tiny random-weight ViT image classifier written by transformers itself (save_pretrained,
safetensors) with its preprocessor_config.json, and test images (PNG/JPEG bytes, a corrupt one,
a decompression bomb). Imports transformers: not for tests/unit."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

LABELS = ("cat", "dog", "fox")


def make_tiny_vit(dir: Path, *, crop: bool = False, seed: int = 0) -> Path:
    """Write a 32x32 ViT (patch 8, 3 labels) and its preprocessor config into `dir`. `crop`:
    resize the shortest edge to 40 with bicubic, then center-crop 32 (else bilinear to 32x32)."""
    from transformers import ViTConfig, ViTForImageClassification

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    labels = dict(enumerate(LABELS))
    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    initializer_range=0.3, num_labels=len(labels), id2label=labels,
                    label2id={v: k for k, v in labels.items()})
    model = ViTForImageClassification(cfg)
    with torch.no_grad():   # biases away from zero, so the head gives varied logits
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("cls_token"):
                p.normal_(0, 0.2)
    model.eval().save_pretrained(dir, safe_serialization=True)
    processor(crop).save_pretrained(dir)
    return dir


def processor(crop: bool) -> Any:
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    if crop:
        return ViTImageProcessorPil(size={"shortest_edge": 40}, resample=3, do_center_crop=True,
                                    crop_size={"height": 32, "width": 32})
    return ViTImageProcessorPil(size={"height": 32, "width": 32})


def image_bytes(seed: int, size: tuple[int, int] = (48, 36), fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """A random image (width, height) encoded as `fmt`."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    img = Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def bomb_png(width: int = 4000, height: int = 4000) -> bytes:
    """A small PNG whose header declares width x height pixels (one grey level: compresses to KBs)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (width, height)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def corrupt_png() -> bytes:
    """A PNG cut short in its pixel data: the header reads, decoding fails."""
    data = image_bytes(99, (64, 64))
    return data[: len(data) // 2]
