"""Task generate_image without a model: a record's settings (its fields over the job's options
over the bundle's defaults) and each bad field's error code, its work (steps x latent pixels x
images, doubled with guidance), batches of one shape bounded by images, PNG text chunks, and
/v1/images/generations lines mapped onto the same fields."""

from __future__ import annotations

import numpy as np
import pytest

from batchinf.openai.lines import IMAGES, parse_line
from batchinf.runtime.diffusion.png import encode_png, png_text, to_uint8
from batchinf.runtime.generation.sampling import derive_seed
from batchinf.tasks.generate_image import GenerateImageOptions, image_key, record_settings, shape_batches, work

META = {"defaults": {"width": 64, "height": 64, "steps": 50, "guidance_scale": 7.5},
        "shape": {"vae_scale_factor": 8, "size_multiple": 8}}


def _settings(fields: dict, **opts: object) -> tuple:
    return record_settings(fields, GenerateImageOptions(**opts), META, "rec-1", "prompt")


def test_fields_over_options_over_bundle_defaults() -> None:
    s, code, _ = _settings({"prompt": "a cat", "width": 128}, steps=20, seed=7)
    assert code is None
    assert s == {"prompt": "a cat", "negative_prompt": None, "width": 128, "height": 64, "steps": 20,
                 "guidance_scale": 7.5, "seed": derive_seed(7, "rec-1"), "num_images": 1}
    s, _, _ = _settings({"prompt": "a cat", "seed": 3, "steps": 4, "n": 2, "negative_prompt": "dog"}, steps=20)
    assert (s["seed"], s["steps"], s["num_images"], s["negative_prompt"]) == (3, 4, 2, "dog")


@pytest.mark.parametrize("fields,code", [
    ({"prompt": ""}, "empty_prompt"), ({}, "empty_prompt"), ({"prompt": ["a"]}, "invalid_prompt"),
    ({"prompt": "p", "negative_prompt": 5}, "invalid_prompt"),
    ({"prompt": "p", "width": 60}, "invalid_size"), ({"prompt": "p", "height": 0}, "invalid_size"),
    ({"prompt": "p", "width": 64.0}, "invalid_size"), ({"prompt": "p", "width": True}, "invalid_size"),
    ({"prompt": "p", "width": 4096, "height": 4096}, "too_many_pixels"),
    ({"prompt": "p", "steps": 0}, "invalid_steps"), ({"prompt": "p", "steps": 101}, "invalid_steps"),
    ({"prompt": "p", "guidance_scale": -1}, "invalid_guidance_scale"),
    ({"prompt": "p", "guidance_scale": "7"}, "invalid_guidance_scale"),
    ({"prompt": "p", "num_images": 9}, "invalid_num_images"), ({"prompt": "p", "seed": 2**63}, "invalid_seed"),
    ({"prompt": "p", "seed": "1"}, "invalid_seed"),
])
def test_each_bad_field_is_its_error(fields: dict, code: str) -> None:
    s, got, message = _settings(fields)
    assert s is None and got == code and message


def test_work_counts_steps_latent_pixels_images_and_guidance() -> None:
    s = {"steps": 10, "width": 512, "height": 256, "num_images": 2, "guidance_scale": 7.5}
    assert work(s, META) == 10 * 64 * 32 * 2 * 2
    assert work({**s, "guidance_scale": 1.0}, META) == 10 * 64 * 32 * 2
    big = {"steps": 50, "width": 1024, "height": 1024, "num_images": 1, "guidance_scale": 7.5}
    small = {"steps": 20, "width": 256, "height": 256, "num_images": 1, "guidance_scale": 7.5}
    assert work(big, META) == 40 * work(small, META)


def test_batches_are_bounded_by_images() -> None:
    c = {"num_images": [1, 2, 1, 3, 1, 5]}
    assert shape_batches(c, list(range(6)), 3) == [[0, 1], [2], [3], [4], [5]]
    assert shape_batches(c, [0, 2, 4], 8) == [[0, 2, 4]]


def test_png_keeps_pixels_and_text() -> None:
    from io import BytesIO

    from PIL import Image

    img = np.random.default_rng(0).random((16, 24, 3), dtype=np.float32)
    data = encode_png(img, {"prompt": "ünï 🚀", "seed": "5", "settings": {"steps": 2}})
    assert data == encode_png(img, {"prompt": "ünï 🚀", "seed": "5", "settings": {"steps": 2}})   # deterministic
    assert png_text(data) == {"prompt": "ünï 🚀", "seed": "5", "settings": '{"steps": 2}'}
    assert (np.asarray(Image.open(BytesIO(data))) == to_uint8(img)).all()
    assert image_key("../../etc/passwd", 1).startswith("images/") and "/" not in image_key("a/b", 0)[7:]


def _line(body: dict) -> object:
    return parse_line({"custom_id": "x", "method": "POST", "url": IMAGES, "body": body}, 0, "line 1", "generate_image")


def test_openai_image_lines_map_onto_the_fields() -> None:
    r = _line({"prompt": "a cat", "n": 2, "size": "512x256", "response_format": "b64_json", "model": "m"})
    assert r.error is None and r.fields == {"prompt": "a cat", "num_images": 2, "width": 512, "height": 256}
    assert r.params == {"response_format": "b64_json"}
    assert _line({"prompt": "a cat", "size": "auto"}).fields == {"prompt": "a cat"}
    assert _line({"prompt": "a"}).params == {"response_format": "url"}
    for body, code in (({"prompt": ""}, "invalid_prompt"), ({"prompt": "a", "size": "1x"}, "invalid_parameter"),
                       ({"prompt": "a", "n": 0}, "invalid_parameter"), ({"prompt": "a", "style": "vivid"},
                                                                          "unsupported_parameter"),
                       ({"prompt": "a", "response_format": "png"}, "invalid_parameter")):
        assert _line(body).error == code
    wrong = parse_line({"custom_id": "x", "method": "POST", "url": IMAGES, "body": {"prompt": "a"}}, 0, "l", "embed")
    assert wrong.error == "endpoint_mismatch"
