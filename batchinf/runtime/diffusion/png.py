"""Images as PNG files: float [0, 1] -> uint8 exactly as diffusers rounds (x * 255, rounded), the
record's prompt, seed, bundle digest and settings in tEXt/iTXt chunks. Encoding is
deterministic (the same pixels and text give the same bytes on the same Pillow)."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np


def to_uint8(image: np.ndarray) -> np.ndarray:
    return (np.clip(image, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_png(image: np.ndarray, text: dict[str, Any]) -> bytes:
    """PNG bytes of a float HxWx3 image with `text` (values as JSON unless strings) as text chunks."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in text.items():
        info.add_itxt(key, value if isinstance(value, str) else json.dumps(value, sort_keys=True))
    buf = io.BytesIO()
    Image.fromarray(to_uint8(image), "RGB").save(buf, format="PNG", pnginfo=info, compress_level=6)
    return buf.getvalue()


def png_text(data: bytes) -> dict[str, str]:
    """The text chunks of PNG bytes."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        img.load()
        return dict(getattr(img, "text", {}))
