"""Parity of task classify_image against transformers: a tiny random ViT written by transformers
(ViTForImageClassification, safetensors) with its ViT image processor (PIL backend) config,
imported as a bundle (preprocessor pinned, fixtures recorded) and run through our decode,
preprocess and ViT runtime: probabilities within 1e-4, identical labels, for images of varied
sizes, modes and formats, with a plain resize and with shortest-edge resize + center crop."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from batchinf.bundles import import_bundle, open_runtime
from batchinf.errors import BundleError
from batchinf.runtime.classifier import activate
from batchinf.runtime.images import decode
from tests.helpers.tiny_vit import LABELS, image_bytes, make_tiny_vit, processor

pytestmark = pytest.mark.parity
IMAGES = [image_bytes(i, (17 + 13 * i, 70 - 7 * i), fmt, mode) for i, (fmt, mode) in enumerate(
    [("PNG", "RGB"), ("JPEG", "RGB"), ("PNG", "RGBA"), ("PNG", "L"), ("WEBP", "RGB"), ("BMP", "P"), ("GIF", "P")])]


@pytest.mark.parametrize("crop", [False, True])
def test_vit_probabilities_match_transformers(tmp_path: Path, bi_home: Path, crop: bool) -> None:
    from PIL import Image
    from transformers import ViTForImageClassification

    src = make_tiny_vit(tmp_path / "vit", crop=crop, seed=4)
    info = import_bundle(src, "vit", alias="prod")
    assert info.task == "classify_image" and info.family == "vit"
    meta = json.loads((Path(info.uri.removeprefix("file://")) / "bundle.json").read_text())
    assert "preprocessor_config.json" in meta["files"] and meta["labels"] == list(LABELS)
    rt = open_runtime(info.digest)

    ours_px = np.stack([rt.preprocessor.to_pixels(decode(b, 10**6)) for b in IMAGES])
    ours = activate(rt.logits(ours_px), rt.meta["activation"])

    hf = ViTForImageClassification.from_pretrained(src).eval()
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in IMAGES]
    with torch.no_grad():
        want = torch.softmax(hf(**processor(crop)(images=pil, return_tensors="pt")).logits, -1).numpy()
    np.testing.assert_allclose(ours, want, atol=1e-4)
    assert ours.argmax(1).tolist() == want.argmax(1).tolist()
    assert len(set(want.argmax(1).tolist())) > 1          # the test can tell labels apart


def test_vit_bundle_refuses_a_preprocessor_that_does_not_fit(tmp_path: Path, bi_home: Path) -> None:
    src = make_tiny_vit(tmp_path / "vit")
    cfg = json.loads((src / "preprocessor_config.json").read_text())
    cfg["size"] = {"height": 48, "width": 48}
    (src / "preprocessor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(BundleError, match="this ViT takes 32x32"):
        import_bundle(src, "vit")


def test_vit_bundle_detects_preprocessor_drift(tmp_path: Path, bi_home: Path) -> None:
    from batchinf.runtime.vit import ImageRuntime
    from batchinf.tasks.image_bundle import verify_pixel_fixtures

    info = import_bundle(make_tiny_vit(tmp_path / "vit"), "vit")
    meta = open_runtime(info.digest, with_model=False).meta
    verify_pixel_fixtures(ImageRuntime(tmp_path / "vit", meta))
    drifted = {**meta, "fixtures": [{**f, "pixels_sha256": "0" * 64} for f in meta["fixtures"]]}
    with pytest.raises(BundleError, match="preprocessing drift"):
        verify_pixel_fixtures(ImageRuntime(tmp_path / "vit", drifted))
