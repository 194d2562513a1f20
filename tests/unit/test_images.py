"""Image decoding under a pixel limit and preprocessing steps (runtime/images.py), with Pillow
alone: a decompression bomb is refused from its header, corrupt bytes are bad_image, and resize /
center crop give the sizes transformers' ViT processor gives."""

from __future__ import annotations

import numpy as np
import pytest

from batchinf.errors import BundleError
from batchinf.runtime.images import ImageProblem, Preprocessor, center_crop, decode
from tests.helpers.tiny_vit import bomb_png, corrupt_png, image_bytes


def test_bomb_is_refused_before_decoding() -> None:
    data = bomb_png(3000, 3000)
    assert len(data) < 100_000                      # small on disk, 9 M pixels declared
    with pytest.raises(ImageProblem) as e:
        decode(data, max_pixels=1_000_000)
    assert e.value.code == "image_too_large" and "9000000 pixels" in str(e.value)
    assert decode(image_bytes(1, (30, 20)), max_pixels=600).size == (30, 20)


@pytest.mark.parametrize("data", [corrupt_png(), b"", b"GIF89a" + b"\0" * 20, b"not an image at all",
                                  b"%PDF-1.4 nope"])
def test_corrupt_or_foreign_bytes_are_bad_images(data: bytes) -> None:
    with pytest.raises(ImageProblem) as e:
        decode(data, max_pixels=10**6)
    assert e.value.code == "bad_image"


def test_modes_become_rgb() -> None:
    for mode in ("L", "RGBA", "P", "CMYK"):
        img = decode(image_bytes(2, (9, 7), "TIFF", mode), 10**6)
        assert img.mode == "RGB" and img.size == (9, 7)


def test_preprocess_sizes_and_normalize() -> None:
    crop = Preprocessor.from_config({"size": {"shortest_edge": 40}, "resample": 3, "do_center_crop": True,
                                     "crop_size": {"height": 32, "width": 32}})
    img = decode(image_bytes(3, (90, 45)), 10**6)
    assert crop.output_size() == (32, 32) and crop.to_pixels(img).shape == (32, 32, 3)
    plain = Preprocessor.from_config({"size": {"height": 16, "width": 24}})
    px = plain.to_pixels(img)
    assert px.shape == (16, 24, 3) and px.dtype == np.uint8
    x = plain.normalize(px[None])
    assert x.shape == (1, 3, 16, 24) and x.dtype == np.float32
    np.testing.assert_allclose(x[0, :, 0, 0], (px[0, 0] / 255 - 0.5) / 0.5, atol=1e-6)
    assert Preprocessor.from_config({"do_resize": False}).output_size() is None
    with pytest.raises(BundleError, match="resample"):
        Preprocessor.from_config({"resample": 9})


def test_center_crop_pads_a_small_image() -> None:
    x = np.full((4, 6, 3), 7, np.uint8)
    y = center_crop(x, 6, 4)
    assert y.shape == (6, 4, 3) and y[0].sum() == 0 and (y[1:5] == 7).all()


def _stage(records: list, monkeypatch: pytest.MonkeyPatch | None = None, cap: int | None = None,
           may_read: object = None) -> list[dict]:
    from types import SimpleNamespace

    from batchinf.formats.record import InputRecord
    from batchinf.tasks import classify_image as ci

    if monkeypatch is not None and cap is not None:
        monkeypatch.setattr(ci, "MAX_STAGED_BYTES", cap)
    obj = SimpleNamespace(input=SimpleNamespace(image_field="img"), pin=SimpleNamespace(uri="file:///in/a.parquet"),
                          options=ci.ClassifyImageOptions(max_pixels=100_000), may_read=may_read)
    runtime = SimpleNamespace(preprocessor=Preprocessor.from_config({"size": {"height": 8, "width": 8}}))
    recs = [InputRecord(i, f"r{i}", None, fields={"img": v}) for i, v in enumerate(records)]
    return ci.ClassifyImage().stage(obj, runtime, iter(recs)).to_pylist()


def test_staging_turns_bad_images_into_error_rows(tmp_path: object) -> None:
    from batchinf.errors import ManifestError

    def deny(uri: str) -> None:
        if "secret" in uri:
            raise ManifestError(f"image {uri} is outside the prefixes tenant 't' may read")

    rows = _stage([image_bytes(1), corrupt_png(), bomb_png(1000, 1000), None, 42, "file:///nowhere/x.png",
                   "file:///secret/x.png", "s3://"], may_read=deny)
    assert [r["error"] for r in rows] == [None, "bad_image", "image_too_large", "missing_image", "invalid_image",
                                          "image_unreachable", "image_forbidden", "image_unreachable"]
    assert rows[0]["n_tokens"] == 64 and len(rows[0]["pixels"]) == 8 * 8 * 3 and rows[0]["image_width"] == 48
    assert all(r["message"].startswith(f"file:///in/a.parquet record 'r{i}'") for i, r in enumerate(rows) if r["error"])


def test_staging_bounds_an_objects_pixels(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.errors import InputError

    assert len(_stage([image_bytes(i) for i in range(3)], monkeypatch, cap=3 * 192)) == 3
    with pytest.raises(InputError, match="split it into smaller objects"):
        _stage([image_bytes(i) for i in range(4)], monkeypatch, cap=3 * 192)
