"""Bundle import for diffusers text-to-image pipelines (task generate_image): bundle.json with
the pipeline class, its latent geometry, the scheduler's config, the pinned dtype, the defaults
records fall back to (width, height, steps, guidance_scale) and a fixture: a fixed prompt and seed
denoised at import on CPU in float32, its final latents' and image's statistics recorded, so a
pipeline that computes something else (diffusers changed, a file swapped under the same name)
is refused at load, naming the fixture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from batchinf.errors import BundleError

FIXTURE = {"name": "red-cube", "prompt": "a photo of a red cube on a blue table", "seed": 1234, "steps": 2}
FIXTURE_SIZE = 64           # pixels a side at most: a fixture costs milliseconds even for a 512x512 model
DEFAULT_STEPS, DEFAULT_GUIDANCE = 50, 7.5       # diffusers' own defaults
STATS = ("mean", "std", "abs_mean")
# tolerance of each fixture statistic: float32 on any CPU; on an accelerator float32 convolutions
# may run in TF32 (cuDNN's default), and half precision rounds far more
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 5e-2}
ACCELERATOR_FLOAT32_TOLERANCE = 1e-2


def stats(x: np.ndarray) -> dict[str, Any]:
    x = np.asarray(x, np.float64)
    return {"mean": round(float(x.mean()), 7), "std": round(float(x.std()), 7),
            "abs_mean": round(float(np.abs(x).mean()), 7), "head": [round(float(v), 6) for v in x.ravel()[:8]]}


def build_diffusion_meta(src: Path, files: list[str], *, dtype: str, task: str) -> dict[str, Any]:
    from batchinf.digests import sha256_file
    from batchinf.runtime.bundle import BUNDLE_FORMAT
    from batchinf.runtime.diffusion.pipeline_dir import pipeline_shape, read_component_config, read_model_index
    from batchinf.runtime.diffusion.runtime import DTYPES, DiffusionRuntime

    if dtype not in DTYPES:
        raise BundleError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    index = read_model_index(src)
    weights = {f.split("/", 1)[0] for f in files if f.endswith(".safetensors")}
    missing = [n for n in ("unet", "vae", "text_encoder") if n not in weights]
    if missing:
        raise BundleError(f"{src}: component {', '.join(missing)} has no *.safetensors weights; batchinf loads "
                          "safetensors only (save the pipeline with save_pretrained(safe_serialization=True))")
    shape = pipeline_shape(src)
    scheduler = read_component_config(src, "scheduler", "scheduler_config.json")
    size = shape["default_size"]
    fixture_size = min(size, FIXTURE_SIZE) // shape["size_multiple"] * shape["size_multiple"] or shape["size_multiple"]
    meta: dict[str, Any] = {
        "format": BUNDLE_FORMAT, "task": task, "family": "diffusers", "pipeline": index["_class_name"],
        "dtype": dtype, "max_length": 0, "shape": shape,
        "scheduler": {"class": scheduler.get("_class_name"), "config": scheduler},
        "defaults": {"width": size, "height": size, "steps": DEFAULT_STEPS, "guidance_scale": DEFAULT_GUIDANCE},
        "files": {f: sha256_file(src / f) for f in files},
    }
    fx = {**FIXTURE, "width": fixture_size, "height": fixture_size, "guidance_scale": DEFAULT_GUIDANCE}
    runtime = DiffusionRuntime(src, {**meta, "fixtures": []}, device="cpu", dtype_override="float32")
    runtime.load_model()
    latents, image = runtime.fixture_latents(fx)
    meta["fixtures"] = [{**fx, "latents": stats(latents), "image": stats(image)}]
    return meta


def verify_diffusion_fixtures(runtime: Any) -> None:
    """Every fixture's latents and image statistics come back within the dtype's tolerance."""
    tol = TOLERANCE.get(runtime.dtype_name, 5e-2)
    if runtime.device != "cpu" and runtime.dtype_name == "float32":
        tol = ACCELERATOR_FLOAT32_TOLERANCE
    for fx in runtime.meta["fixtures"]:
        latents, image = runtime.fixture_latents(fx)
        for what, got in (("latents", stats(latents)), ("image", stats(image))):
            want = fx[what]
            for key in (*STATS, "head"):
                a, b = np.asarray(got[key]), np.asarray(want[key])
                if not np.allclose(a, b, atol=tol, rtol=tol):
                    raise BundleError(
                        f"bundle {runtime.root}: fixture {fx['name']!r} (prompt {fx['prompt']!r}, seed {fx['seed']}, "
                        f"{fx['width']}x{fx['height']}, {fx['steps']} steps) gives {what} {key} {got[key]}, not "
                        f"{want[key]} as at import (tolerance {tol} in {runtime.dtype_name}); the pipeline computes "
                        "something else than it did (diffusers / torch changed, or a file was altered): pin the "
                        "versions the bundle was imported with, or re-import it")
