"""Which diffusers pipeline directories a bundle may be made of. A pipeline is described by its
model_index.json: `_class_name` (the pipeline class) and one `[library, class]` entry per
component. Only classes diffusers or transformers ship are loaded: a custom pipeline (a
`_class_name` given as [module, class], a `custom_pipeline`, a component of another library or a
class neither ships) would run code from the directory, and is refused with the reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchinf.errors import BundleError

# text-to-image pipelines whose __call__ takes prompt / negative_prompt / height / width /
# num_inference_steps / guidance_scale / latents / callback_on_step_end, as the runtime calls it
PIPELINES = ("StableDiffusionPipeline",)
LIBRARIES = ("diffusers", "transformers")
NEEDED = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
# stochastic schedulers draw noise at every step: reproducible per record only with one generator
# per image, which the runtime passes; all others are deterministic given the initial latents
MAX_INDEX_BYTES = 1 << 20


def read_model_index(src: Path) -> dict[str, Any]:
    """model_index.json of a pipeline directory, checked: a known pipeline class whose components
    are all classes of diffusers or transformers."""
    path = src / "model_index.json"
    if path.stat().st_size > MAX_INDEX_BYTES:
        raise BundleError(f"{path} is over {MAX_INDEX_BYTES} bytes; it is not a diffusers model_index.json")
    try:
        index = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(index, dict):
        raise BundleError(f"{path} must be a JSON object")
    cls = index.get("_class_name")
    if not isinstance(cls, str):
        raise BundleError(f"{path}: _class_name {cls!r} names a custom pipeline (code shipped with the model, "
                          f"loaded as remote code); batchinf runs only diffusers' own pipelines: {', '.join(PIPELINES)}")
    if cls not in PIPELINES:
        raise BundleError(f"{path}: pipeline class {cls!r} is not supported; supported: {', '.join(PIPELINES)}")
    if "custom_pipeline" in index or "auto_map" in index:
        raise BundleError(f"{path}: custom_pipeline / auto_map load remote code; batchinf refuses code shipped "
                          "with a model (remove them to use diffusers' own pipeline class)")
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list):
            continue
        if len(entry) != 2:
            raise BundleError(f"{path}: component {name!r} is {entry!r}, not [library, class]")
        library, klass = entry
        if library is None and klass is None:
            if name in NEEDED:
                raise BundleError(f"{path}: component {name!r} is missing; a {cls} needs {', '.join(NEEDED)}")
            continue
        if library not in LIBRARIES:
            raise BundleError(f"{path}: component {name!r} is class {klass!r} of {library!r}: a custom class "
                              f"(remote code), refused; components must be classes of {' or '.join(LIBRARIES)}")
        if not isinstance(klass, str) or not klass.isidentifier() or not _known(library, klass):
            raise BundleError(f"{path}: component {name!r}: {library} has no class {klass!r} (custom code is "
                              "refused); use a class the installed diffusers / transformers ship")
        if not (src / name).is_dir():
            raise BundleError(f"{path}: component folder {name}/ is missing")
    for name in NEEDED:
        if not isinstance(index.get(name), list):
            raise BundleError(f"{path}: component {name!r} is missing; a {cls} needs {', '.join(NEEDED)}")
    if index.get("safety_checker") not in (None, [None, None]):
        raise BundleError(f"{path}: a safety_checker component is not supported (it replaces images by black "
                          "ones outside batchinf's records); save the pipeline with safety_checker=None")
    return index


def _known(library: str, klass: str) -> bool:
    import importlib

    try:
        return isinstance(getattr(importlib.import_module(library), klass, None), type)
    except ImportError:
        return False


def read_component_config(src: Path, name: str, file: str = "config.json") -> dict[str, Any]:
    path = src / name / file
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path} cannot be read ({exc}); the pipeline directory is incomplete") from None


def pipeline_shape(src: Path) -> dict[str, Any]:
    """The pipeline's latent geometry and default size, from its component configs: VAE scale
    factor (2 ** (VAE blocks - 1)), latent channels, the size the UNet was trained at, and the
    multiple a width or height must be (8, as diffusers checks, and whole latent pixels)."""
    unet = read_component_config(src, "unet")
    vae = read_component_config(src, "vae")
    scale = 2 ** (len(vae.get("block_out_channels") or [1]) - 1)
    sample = unet.get("sample_size") or 64
    sample = sample[0] if isinstance(sample, list) else sample
    return {"vae_scale_factor": scale, "latent_channels": int(unet.get("in_channels", 4)),
            "size_multiple": max(8, scale), "default_size": int(sample) * scale,
            "vae_channels": max(vae.get("block_out_channels") or [128])}
