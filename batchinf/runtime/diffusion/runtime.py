"""DiffusionRuntime: a bundle's diffusers pipeline on one device, denoising one batch of one
latent shape (size, steps, guidance) at a time.

Reproducibility per record: each record's initial latents are drawn from its own
`torch.Generator` seeded with the record's seed, in one draw of (images, C, h, w) exactly as
diffusers draws them for one prompt and one generator, then handed to the pipeline as `latents`;
the pipeline draws nothing else for a deterministic scheduler (a stochastic one gets the record's
generator for each of its images). So a record's image depends on its own fields only, not on
its batch, its shard or its attempt (up to the float tolerance of a different batch size)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from batchinf.errors import BundleError

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ImageRequest:
    prompt: str
    negative_prompt: str | None
    seed: int
    num_images: int


class DiffusionRuntime:
    def __init__(self, root: Path, meta: dict[str, Any], device: str = "cpu",
                 dtype_override: str | None = None) -> None:
        self.root, self.meta, self.device, self.dtype_override = Path(root), meta, device, dtype_override
        self.pipe: Any = None
        self.progress_done = 0     # image-steps denoised by this process (Task.progress_unit: steps)
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        """The bundle's digest (of its bundle.json), written into every PNG."""
        if self._digest is None:
            from batchinf.runtime.bundle import digest_of

            self._digest = digest_of(self.meta)
        return self._digest

    def step_done(self, images: int) -> None:
        """A denoising step of a batch of `images` finished."""
        self.progress_done += images

    @property
    def dtype_name(self) -> str:
        """float32 on a CPU; on an accelerator the bundle's pinned dtype."""
        return "float32" if self.device == "cpu" else (self.dtype_override or self.meta.get("dtype", "float32"))

    def load_model(self) -> None:
        import os

        import torch

        os.environ.setdefault("HF_HUB_OFFLINE", "1")        # a bundle is local files; never a hub
        from diffusers import StableDiffusionPipeline
        from diffusers.utils import logging as dlog

        from transformers.utils import logging as tlog

        for log in (dlog, tlog):
            log.set_verbosity_error()
            log.disable_progress_bar()
        try:
            pipe = StableDiffusionPipeline.from_pretrained(
                self.root, dtype=getattr(torch, self.dtype_name), use_safetensors=True, local_files_only=True,
                safety_checker=None, feature_extractor=None, requires_safety_checker=False)
        except (OSError, ValueError, EnvironmentError) as exc:
            raise BundleError(f"bundle {self.root}: the diffusers pipeline does not load ({exc})") from None
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe.to(self.device)

    @property
    def vae_scale_factor(self) -> int:
        return int(self.meta["shape"]["vae_scale_factor"])

    def memory_bytes(self, images: int, width: int, height: int, guidance: float) -> int:
        """Bytes the latents and activations of a batch of `images` take, roughly: the VAE decoder
        at full resolution (its widest block's channels, a few live tensors, per image) dominates;
        the UNet runs on latents at twice the batch with classifier-free guidance."""
        shape = self.meta["shape"]
        per_value = 4 if self.dtype_name == "float32" else 2
        decode = width * height * int(shape["vae_channels"]) * 4
        s = self.vae_scale_factor
        unet = (2 if guidance > 1 else 1) * (width // s) * (height // s) * 320 * 8
        return images * (decode + unet) * per_value

    def denoise(self, requests: list[ImageRequest], *, width: int, height: int, steps: int, guidance: float,
                on_step: Callable[[int], None] | None = None) -> np.ndarray:
        """Images (n, height, width, 3) float32 in [0, 1], the requests' images in order, each
        record's `num_images` after one another. `on_step(i)` runs after each denoising step (it
        may raise to stop the batch)."""
        import torch

        pipe = self.pipe
        s = self.vae_scale_factor
        shape = (int(self.meta["shape"]["latent_channels"]), height // s, width // s)
        dtype = getattr(torch, self.dtype_name)
        gens = [torch.Generator("cpu").manual_seed(int(r.seed)) for r in requests]
        latents = torch.cat([torch.randn((r.num_images, *shape), generator=g, dtype=dtype)
                             for r, g in zip(requests, gens)]).to(self.device)
        prompts = [r.prompt for r in requests for _ in range(r.num_images)]
        negatives = [r.negative_prompt or "" for r in requests for _ in range(r.num_images)]
        any_negative = any(r.negative_prompt for r in requests)

        def callback(pipe: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            if on_step is not None:
                on_step(i)
            return kwargs

        with torch.inference_mode():
            out = pipe(prompt=prompts, negative_prompt=negatives if any_negative else None, height=height, width=width,
                       num_inference_steps=steps, guidance_scale=guidance, latents=latents,
                       generator=[g for r, g in zip(requests, gens) for _ in range(r.num_images)],
                       output_type="np", callback_on_step_end=callback)
        return np.asarray(out.images, dtype=np.float32)

    def fixture_latents(self, fx: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """(final latents, image) of a bundle fixture."""
        import torch

        final: dict[str, Any] = {}
        pipe = self.pipe

        def keep(pipe: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            final["latents"] = kwargs["latents"].detach().float().cpu().numpy()
            return kwargs

        s = self.vae_scale_factor
        shape = (1, int(self.meta["shape"]["latent_channels"]), fx["height"] // s, fx["width"] // s)
        latents = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(fx["seed"]),
                              dtype=getattr(torch, self.dtype_name)).to(self.device)
        with torch.inference_mode():
            out = pipe(prompt=[fx["prompt"]], height=fx["height"], width=fx["width"], num_inference_steps=fx["steps"],
                       guidance_scale=fx["guidance_scale"], latents=latents, output_type="np",
                       callback_on_step_end=keep)
        return final["latents"], np.asarray(out.images, dtype=np.float32)
