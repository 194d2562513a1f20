"""Images for vision models: decoding tenant bytes with Pillow under a pixel limit, and the
preprocessing a model's preprocessor_config.json describes (resize, center crop, rescale,
normalize), step for step as transformers' ViT image processor (PIL backend) does it.

Decoding is split in two so a decompression bomb costs nothing: the header gives the size, which
is checked against the limit before a single pixel is decoded.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchinf.errors import BundleError

# The formats we open; anything else is a bad_image row (a smaller parser surface for hostile bytes).
FORMATS = ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"]
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


class ImageProblem(Exception):
    """A record's image cannot be used: `code` is its error row's code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def decode(data: bytes, max_pixels: int) -> Any:
    """Image bytes -> an RGB PIL image. ImageProblem image_too_large when its header declares more
    than `max_pixels` pixels (checked before decoding), bad_image when it is not a readable image."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageProblem("image_too_large", f"its header declares a decompression bomb ({exc})") from None
    except Exception as exc:  # noqa: BLE001 -- Pillow raises many types on hostile bytes
        raise ImageProblem("bad_image", f"is not a readable {'/'.join(FORMATS)} image "
                                        f"({type(exc).__name__}: {str(exc)[:120]})") from None
    w, h = img.size
    if w * h > max_pixels:
        raise ImageProblem("image_too_large", f"is {w}x{h} = {w * h} pixels, over the limit of {max_pixels} "
                                              "(options.max_pixels); downscale it or raise the limit")
    if w == 0 or h == 0:
        raise ImageProblem("bad_image", f"is {w}x{h}: an image with no pixels")
    try:
        img.seek(0)          # animated: the first frame
        img.load()
        return img.convert("RGB")
    except Exception as exc:  # noqa: BLE001 -- truncated or corrupt data surfaces only here
        raise ImageProblem("bad_image", f"is corrupt ({type(exc).__name__}: {str(exc)[:120]})") from None


@dataclass(frozen=True)
class Preprocessor:
    """The steps of a preprocessor_config.json that ViT-family models use."""
    do_resize: bool
    size: dict[str, int]            # {height, width} or {shortest_edge}
    resample: int                   # a PIL resampling filter
    do_center_crop: bool
    crop_size: dict[str, int]
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Preprocessor:
        def triple(key: str, default: float) -> tuple[float, float, float]:
            v = cfg.get(key, default)
            v = [v] * 3 if isinstance(v, (int, float)) else list(v)
            if len(v) != 3:
                raise BundleError(f"preprocessor_config.json {key} must have 3 values (RGB), got {len(v)}")
            return (float(v[0]), float(v[1]), float(v[2]))

        size = cfg.get("size", {"height": 224, "width": 224})
        if isinstance(size, int):
            size = {"height": size, "width": size}
        crop = cfg.get("crop_size") or {}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        resample = int(cfg.get("resample", 2))
        if resample not in RESAMPLE_NAMES:
            raise BundleError(f"preprocessor_config.json resample {resample} is not a PIL filter")
        p = cls(bool(cfg.get("do_resize", True)), {k: int(v) for k, v in size.items() if v is not None}, resample,
                bool(cfg.get("do_center_crop", False)), {k: int(v) for k, v in crop.items() if v is not None},
                bool(cfg.get("do_rescale", True)), float(cfg.get("rescale_factor", 1 / 255)),
                bool(cfg.get("do_normalize", True)), triple("image_mean", 0.5), triple("image_std", 0.5))
        if p.do_resize and not ({"height", "width"} <= set(p.size) or "shortest_edge" in p.size):
            raise BundleError(f"preprocessor_config.json size {size} is not supported; use height and width, "
                              "or shortest_edge with a center crop")
        if p.do_center_crop and not {"height", "width"} <= set(p.crop_size):
            raise BundleError("preprocessor_config.json do_center_crop needs crop_size {height, width}")
        return p

    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every preprocessed image, or None when it varies with the input."""
        if self.do_center_crop:
            return self.crop_size["height"], self.crop_size["width"]
        if self.do_resize and "height" in self.size:
            return self.size["height"], self.size["width"]
        return None

    def to_pixels(self, img: Any) -> np.ndarray:
        """RGB PIL image -> resized and cropped uint8 [H, W, 3] (what the plan stages)."""
        if self.do_resize:
            if "height" in self.size:
                h, w = self.size["height"], self.size["width"]
            else:
                s, (W, H) = self.size["shortest_edge"], img.size
                h, w = (int(s * H / W), s) if W <= H else (s, int(s * W / H))
            img = img.resize((w, h), resample=self.resample, reducing_gap=None)
        x = np.asarray(img, dtype=np.uint8)
        if self.do_center_crop:
            x = center_crop(x, self.crop_size["height"], self.crop_size["width"])
        return np.ascontiguousarray(x)

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 [B, H, W, 3] -> float32 [B, 3, H, W], rescaled and normalized as transformers does
        (rescale in float64 then float32; normalize in float32)."""
        x = pixels.astype(np.float64) * self.rescale_factor if self.do_rescale else pixels
        x = np.asarray(x, dtype=np.float32)
        if self.do_normalize:
            x = (x - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32)


def center_crop(x: np.ndarray, ch: int, cw: int) -> np.ndarray:
    """Crop [H, W, C] to (ch, cw) around its center, zero-padding a smaller image as transformers does."""
    h, w = x.shape[:2]
    if h < ch or w < cw:
        ph, pw = max(ch, h), max(cw, w)
        padded = np.zeros((ph, pw, x.shape[2]), x.dtype)
        top, left = (ph - h + 1) // 2, (pw - w + 1) // 2
        padded[top:top + h, left:left + w] = x
        x, h, w = padded, ph, pw
    top, left = (h - ch) // 2, (w - cw) // 2
    return x[top:top + ch, left:left + cw]


def read_preprocessor(root: Path) -> Preprocessor:
    path = Path(root) / "preprocessor_config.json"
    try:
        return Preprocessor.from_config(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise BundleError(f"cannot read {path}: {exc}") from exc


def fixture_images() -> list[Any]:
    """Deterministic images the bundle's fixtures are computed on (sizes and aspects vary)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:45, 0:60]
    gradient = np.stack([xx * 4, yy * 5, (xx + yy) * 2], -1).astype(np.uint8)
    checker = (((np.indices((31, 17)).sum(0) // 3) % 2) * 255).astype(np.uint8)
    noise = rng.integers(0, 256, (64, 80, 3), dtype=np.uint8)
    return [Image.fromarray(gradient), Image.fromarray(checker).convert("RGB"), Image.fromarray(noise)]


def pixels_digest(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x, dtype=np.uint8).tobytes()).hexdigest()
