"""`batchinf bundle import` of a diffusers pipeline directory (task generate_image): the pinned
bundle.json (scheduler config, dtype, defaults, fixture statistics, every file's digest), refusals
(pickle weights, custom pipeline classes and components, unknown pipelines, a safety checker), and
a fixture that differs refused at load, naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from batchinf.bundles import import_bundle, local_dir, open_runtime
from batchinf.errors import BundleError
from batchinf.runtime import bundle as rb
from batchinf.runtime.diffusion.runtime import DiffusionRuntime
from batchinf.tasks.diffusion_bundle import verify_diffusion_fixtures
from tests.helpers.tiny_diffusion import cached_pipeline

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_pipeline(tmp_path_factory.mktemp("tiny-diffusion"), "ddim")


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "pipe"
    shutil.copytree(src, dst)
    return dst


def _edit_index(dir: Path, **changes: object) -> None:
    index = json.loads((dir / "model_index.json").read_text())
    index.update(changes)
    (dir / "model_index.json").write_text(json.dumps(index))


def test_import_pins_the_pipeline(pipeline: Path, bi_home: Path) -> None:
    info = import_bundle(pipeline, "sd", alias="prod")
    assert info.task == "generate_image" and info.family == "diffusers"
    meta = rb.read_meta(local_dir(info.digest))
    assert rb.digest_of(meta) == info.digest
    assert meta["pipeline"] == "StableDiffusionPipeline" and meta["dtype"] == "float32"
    assert meta["scheduler"]["class"] == "DDIMScheduler"
    assert meta["scheduler"]["config"]["beta_schedule"] == "scaled_linear"
    assert meta["defaults"] == {"width": 64, "height": 64, "steps": 50, "guidance_scale": 7.5}
    assert meta["shape"]["vae_scale_factor"] == 2 and meta["shape"]["size_multiple"] == 8
    assert {"model_index.json", "unet/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json",
            "tokenizer/tokenizer.json"} <= set(meta["files"])
    (fx,) = meta["fixtures"]
    assert fx["name"] == "red-cube" and fx["latents"]["std"] > 0 and 0 < fx["image"]["mean"] < 1
    rt = open_runtime(info.digest)          # files and the fixture verified at load
    assert rt.pipe is not None
    again = import_bundle(pipeline, "sd")   # the same directory: the same digest
    assert again.digest == info.digest


def test_a_fixture_that_differs_is_refused_naming_it(pipeline: Path, bi_home: Path) -> None:
    digest = import_bundle(pipeline, "sd").digest
    meta = rb.read_meta(local_dir(digest))
    meta["fixtures"][0]["latents"]["std"] += 0.01
    rt = DiffusionRuntime(local_dir(digest), meta)
    rt.load_model()
    with pytest.raises(BundleError, match=r"fixture 'red-cube' .* latents std"):
        verify_diffusion_fixtures(rt)


@pytest.mark.parametrize("change,match", [
    ({"unet": ["my_unets", "FancyUNet"]}, "custom class"),
    ({"unet": ["diffusers", "NoSuchUNetClass"]}, "has no class"),
    ({"_class_name": ["pipeline_mine", "MyPipeline"]}, "custom pipeline"),
    ({"_class_name": "StableDiffusionXLInpaintPipeline"}, "is not supported"),
    ({"custom_pipeline": "lpw_stable_diffusion"}, "remote code"),
    ({"safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"]}, "custom class"),
    ({"vae": [None, None]}, "'vae' is missing"),
])
def test_pipelines_needing_code_or_unknown_are_refused(pipeline: Path, tmp_path: Path, bi_home: Path,
                                                       change: dict, match: str) -> None:
    dir = _copy(pipeline, tmp_path)
    _edit_index(dir, **change)
    with pytest.raises(BundleError, match=match):
        import_bundle(dir, "bad")


def test_pickle_weights_are_refused(pipeline: Path, tmp_path: Path, bi_home: Path) -> None:
    dir = _copy(pipeline, tmp_path)
    (dir / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(BundleError, match="refusing pickle"):
        import_bundle(dir, "bad")
    (dir / "unet" / "diffusion_pytorch_model.bin").unlink()
    (dir / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(BundleError, match="unet has no .*safetensors"):
        import_bundle(dir, "bad")
