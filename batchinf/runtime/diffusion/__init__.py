"""The runtime of task generate_image: a diffusers text-to-image pipeline from a bundle directory.

- `pipeline_dir.py`: what bundle import accepts (model_index.json of a known diffusers pipeline
  class, components of diffusers / transformers classes only, safetensors only) and the
  defaults it reads from the pipeline (size, steps, guidance, scheduler config).
- `runtime.py`: `DiffusionRuntime` loads the pipeline and denoises one batch of one latent shape,
  each record's initial latents drawn from its own `torch.Generator`, so a record's image does not
  depend on what it is batched with; a callback at every step reports progress and stops a
  cancelled batch.
- `png.py`: float images -> PNG bytes with the record's prompt, seed, bundle digest and settings
  in text chunks.
"""
