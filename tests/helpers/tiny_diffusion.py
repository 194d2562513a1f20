"""A tiny random StableDiffusionPipeline written by diffusers itself (save_pretrained, safetensors),
built as diffusers' own tests build theirs: a UNet2DConditionModel with channels (32, 64) and
cross-attention 32, a two-block AutoencoderKL (latents at half the image size) and a 5-layer
CLIPTextModel with a CLIP BPE tokenizer whose vocab and merges are written here. Images of 32x32
or 64x64 in 2-4 steps take milliseconds. Imports diffusers: not for tests/unit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SCHEDULERS = ("pndm", "ddim", "euler")
WORDS = ("a", "cat", "dog", "red", "blue", "photo", "of", "the", "house", "tree", "sky", "small", "big")


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_clip_tokenizer(dir: Path) -> Any:
    """A CLIP BPE tokenizer over single bytes plus merges that spell WORDS (ids < 1000)."""
    from transformers import CLIPTokenizer

    dir.mkdir(parents=True, exist_ok=True)
    chars = list(_bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars]
    merges: list[str] = []
    for w in WORDS:
        cur = w[0]
        for i, ch in enumerate(w[1:], 1):
            tail = ch + ("</w>" if i == len(w) - 1 else "")
            merges.append(f"{cur} {tail}")
            cur = cur + tail
            if cur not in vocab:
                vocab.append(cur)
    merges = list(dict.fromkeys(merges))
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    (dir / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return CLIPTokenizer(vocab=str(dir / "vocab.json"), merges=str(dir / "merges.txt"), model_max_length=77)


def scheduler(kind: str) -> Any:
    from diffusers import DDIMScheduler, EulerDiscreteScheduler, PNDMScheduler

    common = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "steps_offset": 1}
    if kind == "ddim":
        return DDIMScheduler(**common, clip_sample=False, set_alpha_to_one=False)
    if kind == "euler":
        return EulerDiscreteScheduler(**common)
    return PNDMScheduler(**common, skip_prk_steps=True)


def make_tiny_pipeline(dir: Path, *, scheduler_kind: str = "pndm", seed: int = 0) -> Path:
    """Write the tiny pipeline into `dir` (model_index.json and its component folders)."""
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    dir = Path(dir)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32)
    torch.manual_seed(seed)
    vae = AutoencoderKL(block_out_channels=[32, 64], in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
                        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"], latent_channels=4)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, hidden_size=32, intermediate_size=37, layer_norm_eps=1e-05,
        num_attention_heads=4, num_hidden_layers=5, pad_token_id=1, vocab_size=1000))
    tokenizer = write_clip_tokenizer(dir.parent / f".{dir.name}-tok")
    pipe = StableDiffusionPipeline(unet=unet, scheduler=scheduler(scheduler_kind), vae=vae, text_encoder=text_encoder,
                                   tokenizer=tokenizer, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(dir, safe_serialization=True)
    return dir


def reference_pipeline(dir: Path) -> Any:
    """diffusers' own StableDiffusionPipeline loaded from `dir` (the parity reference)."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(dir, use_safetensors=True, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def cached_pipeline(cache: Path, scheduler_kind: str = "pndm") -> Path:
    """The tiny pipeline with `scheduler_kind`, written once under `cache` (a session directory)."""
    dir = Path(cache) / f"tiny-sd-{scheduler_kind}"
    if not (dir / "model_index.json").exists():
        make_tiny_pipeline(dir, scheduler_kind=scheduler_kind)
    return dir


def reference_images(pipe: Any, records: list[dict[str, Any]], **settings: Any) -> Any:
    """diffusers' own images (n, H, W, 3) float32 for records {prompt, negative_prompt?, seed,
    num_images?} called one record at a time, each with its own generator."""
    import numpy as np

    out = []
    for r in records:
        images = pipe(prompt=r["prompt"], negative_prompt=r.get("negative_prompt"),
                      num_images_per_prompt=r.get("num_images", 1), generator=torch.Generator().manual_seed(r["seed"]),
                      output_type="np", **settings).images
        out.append(np.asarray(images, np.float32))
    return np.concatenate(out)
