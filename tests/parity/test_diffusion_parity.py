"""Parity of task generate_image's runtime against diffusers' own StableDiffusionPipeline on a
tiny random pipeline (tests/helpers/tiny_diffusion.py) imported as a bundle: the same prompts,
seeds and settings give images within 1e-5 in float32 with the PNDM, DDIM and Euler schedulers;
a batch of records gives each record's image alone (one generator per record), and a record of
several images gives what diffusers gives for one prompt and one generator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from batchinf.bundles import import_bundle, open_runtime
from batchinf.runtime.diffusion.runtime import ImageRequest
from tests.helpers.tiny_diffusion import cached_pipeline, reference_images, reference_pipeline

pytestmark = pytest.mark.parity
RECORDS = [{"prompt": "a photo of a red cat", "seed": 11}, {"prompt": "blue sky over the house", "seed": 12},
           {"prompt": "a big tree", "negative_prompt": "small dog", "seed": 13},
           {"prompt": "the small house", "seed": 2**62 + 5}]
TOL = 1e-5


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-diffusion")


def _requests(records: list[dict]) -> list[ImageRequest]:
    return [ImageRequest(r["prompt"], r.get("negative_prompt"), r["seed"], r.get("num_images", 1)) for r in records]


@pytest.mark.parametrize("kind,size,steps,guidance", [("pndm", (32, 32), 3, 7.5), ("ddim", (64, 32), 2, 5.0),
                                                      ("euler", (32, 64), 3, 1.0)])
def test_images_match_diffusers(cache: Path, bi_home: Path, kind: str, size: tuple[int, int], steps: int,
                                guidance: float) -> None:
    src = cached_pipeline(cache, kind)
    rt = open_runtime(import_bundle(src, f"sd-{kind}").digest)
    assert rt.meta["scheduler"]["class"].lower().startswith(kind)
    w, h = size
    settings = {"width": w, "height": h, "num_inference_steps": steps, "guidance_scale": guidance}
    want = reference_images(reference_pipeline(src), RECORDS, **settings)
    got = rt.denoise(_requests(RECORDS), width=w, height=h, steps=steps, guidance=guidance)
    assert got.shape == want.shape == (len(RECORDS), h, w, 3)
    assert np.abs(got - want).max() <= TOL
    assert np.abs(want[0] - want[1]).max() > 1e-2          # the records differ: the comparison can fail
    alone = np.concatenate([rt.denoise(_requests([r]), width=w, height=h, steps=steps, guidance=guidance)
                            for r in RECORDS])
    assert np.abs(alone - got).max() <= TOL                 # batched vs one at a time


def test_several_images_per_record_match_diffusers(cache: Path, bi_home: Path) -> None:
    src = cached_pipeline(cache, "pndm")
    rt = open_runtime(import_bundle(src, "sd").digest)
    records = [{"prompt": "a red dog", "seed": 5, "num_images": 3}, {"prompt": "a blue cat", "seed": 6}]
    want = reference_images(reference_pipeline(src), records, width=32, height=32, num_inference_steps=2,
                            guidance_scale=7.5)
    got = rt.denoise(_requests(records), width=32, height=32, steps=2, guidance=7.5)
    assert got.shape[0] == 4 and np.abs(got - want).max() <= TOL
    assert np.abs(got[0] - got[1]).max() > 1e-2             # a record's images differ from each other
