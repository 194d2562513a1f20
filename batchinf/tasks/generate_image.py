"""Task generate_image: a text prompt -> images from a diffusers text-to-image pipeline.

Records: `prompt` (input.prompt_field), optional `negative_prompt`, `width`, `height`, `steps`,
`guidance_scale`, `seed`, `num_images`; what a record leaves out comes from the job's options,
then from the bundle's defaults. At plan time each record is checked (bad ones are error rows:
empty_prompt, invalid_prompt, invalid_size, too_many_pixels, invalid_steps, invalid_guidance_scale,
invalid_seed, invalid_num_images) and its seed resolved (its own, else derived from the job's seed
and its id). Length measure (`n_tokens`): its denoising work, steps x latent pixels x images,
doubled with classifier-free guidance (guidance_scale > 1), so planning sorts, buckets and sizes
shards by work, and records of one shape (size, steps, guidance) sit together.

At execute a shard's records are grouped by latent shape and denoised in batches of one shape,
as many images as `max_batch_images` and the worker's memory budget allow; each record's latents
come from its own generator (runtime/diffusion/runtime.py), so batching, splitting and retries give
the same image. Each image is a PNG staged under the attempt's prefix (`parts.AttemptFiles`) for
its key under the output's `images/`, a key derived from the record id (a retry stages the same
bytes for the same key), encoded and staged on threads while the next batch denoises
(`ImageWriter`); publish copies the committed attempts' images to `images/`. The result row lists
the image URIs under the output and their sha256, and `_MANIFEST.json` lists every image."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from batchinf.errors import JobStopped
from batchinf.manifest_rules import INT64_MAX, LIMITED, STRING, Section, choice, integer, nullable, number, positive
from batchinf.tasks.base import (RECORD_FIELDS, STAGE_FIELDS, RunOutput, StagedRows, Task, ok_rows,
                                 record_columns, usable_records)
from batchinf.tasks.batching import hit_record_failpoints, isolate
from batchinf.tasks.embed import DEVICES

MAX_SIDE = 1 << 14              # pixels a side: no operator limit covers a single dimension
MAX_GUIDANCE = 100.0
MAX_PROMPT_CHARS = 1 << 16

IMAGE_GEN_STAGE_SCHEMA = pa.schema(STAGE_FIELDS + [
    ("prompt", pa.string()), ("negative_prompt", pa.string()), ("width", pa.int32()), ("height", pa.int32()),
    ("steps", pa.int32()), ("guidance_scale", pa.float64()), ("seed", pa.int64()), ("num_images", pa.int32()),
    ("images_uri", pa.string()),        # the output's images/ prefix the record's PNGs go to
    ("response_format", pa.string()),   # an OpenAI line's: url | b64_json; null otherwise
])
IMAGE_GEN_SCHEMA = pa.schema(RECORD_FIELDS + [
    ("image_uris", pa.list_(pa.string())), ("image_keys", pa.list_(pa.string())),
    ("image_sha256", pa.list_(pa.string())), ("width", pa.int32()), ("height", pa.int32()),
    ("seed", pa.int64()), ("steps", pa.int32()), ("guidance_scale", pa.float64()), ("num_images", pa.int32()),
    ("scheduler", pa.string()), ("response_format", pa.string()),
])


class GenerateImageOptions(Section):
    """Options of task generate_image. A record's own field wins over the job's option, which wins
    over the bundle's default."""
    width: Annotated[int | None, nullable(positive(MAX_SIDE))] = Field(None, description="default: the bundle's")
    height: Annotated[int | None, nullable(positive(MAX_SIDE))] = Field(None, description="default: the bundle's")
    steps: Annotated[int | None, nullable(LIMITED)] = Field(None, description="denoising steps; default: the bundle's")
    guidance_scale: Annotated[float | None, nullable(number(0, MAX_GUIDANCE))] = Field(
        None, description="classifier-free guidance (above 1 doubles the work); default: the bundle's")
    negative_prompt: Annotated[str | None, nullable(STRING)] = None
    num_images: Annotated[int, LIMITED] = Field(1, description="images per record unless the record says")
    seed: Annotated[int, integer(0)] = Field(
        0, description="job seed: a record without its own seed uses one derived from it and the record id")
    max_pixels: Annotated[int, LIMITED] = Field(
        1 << 20, description="width x height of a record, at most (over it: a too_many_pixels error row)")
    max_steps: Annotated[int, LIMITED] = Field(100, description="steps of a record, at most (else invalid_steps)")
    max_images: Annotated[int, LIMITED] = Field(8, description="num_images of a record, at most")
    max_batch_images: Annotated[int, positive(4096)] = Field(8, description="images denoised together, at most")
    device: Annotated[str, choice(DEVICES)] = "auto"


def image_key(record_id: str, k: int) -> str:
    """The output key of a record's k-th image: stable for a record id, safe whatever the id holds."""
    return f"images/{hashlib.sha256(record_id.encode()).hexdigest()[:24]}-{k}.png"


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def record_settings(fields: dict[str, Any], opts: GenerateImageOptions, meta: dict[str, Any], record_id: str,
                    prompt_field: str) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """(settings, error code, message) of one record: its fields, the job's options, the bundle's defaults."""
    from batchinf.runtime.generation.sampling import derive_seed

    d = meta["defaults"]
    prompt = fields.get(prompt_field)
    if prompt is None or (isinstance(prompt, str) and not prompt.strip()):
        return None, "empty_prompt", f"has no prompt in field {prompt_field!r} (or it is blank); give a text prompt"
    if not isinstance(prompt, str) or len(prompt) > MAX_PROMPT_CHARS:
        return None, "invalid_prompt", f"prompt must be a string of at most {MAX_PROMPT_CHARS} characters"
    negative = fields.get("negative_prompt", opts.negative_prompt)
    if negative is not None and not isinstance(negative, str):
        return None, "invalid_prompt", "negative_prompt must be a string"

    def pick(name: str) -> Any:
        v = fields.get(name)
        if v is None:
            v = getattr(opts, name)
        return d[name] if v is None else v

    s = {name: pick(name) for name in ("width", "height", "steps", "guidance_scale")}
    multiple = int(meta["shape"]["size_multiple"])
    for name in ("width", "height"):
        v = s[name]
        if not _int(v) or not 0 < v <= MAX_SIDE or v % multiple:
            return None, "invalid_size", (f"{name} {v!r} must be a positive multiple of {multiple} (at most {MAX_SIDE}); "
                                          f"round it to a multiple of {multiple}")
    if s["width"] * s["height"] > opts.max_pixels:
        return None, "too_many_pixels", (f"{s['width']}x{s['height']} = {s['width'] * s['height']} pixels is over "
                                         f"options.max_pixels {opts.max_pixels}; make the image smaller")
    if not _int(s["steps"]) or not 1 <= s["steps"] <= opts.max_steps:
        return None, "invalid_steps", f"steps {s['steps']!r} must be an integer from 1 to options.max_steps {opts.max_steps}"
    g = s["guidance_scale"]
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g <= MAX_GUIDANCE:
        return None, "invalid_guidance_scale", f"guidance_scale {g!r} must be a number from 0 to {MAX_GUIDANCE:g}"
    n = fields.get("num_images", fields.get("n"))
    n = opts.num_images if n is None else n
    if not _int(n) or not 1 <= n <= opts.max_images:
        return None, "invalid_num_images", f"num_images {n!r} must be an integer from 1 to options.max_images {opts.max_images}"
    seed = fields.get("seed")
    if seed is None:
        seed = derive_seed(opts.seed, record_id)
    elif not _int(seed) or not 0 <= seed <= INT64_MAX:
        return None, "invalid_seed", f"seed {seed!r} must be an integer from 0 to {INT64_MAX}"
    return {"prompt": prompt, "negative_prompt": negative, **s, "guidance_scale": float(g), "seed": seed,
            "num_images": n}, None, None


def work(s: dict[str, Any], meta: dict[str, Any]) -> int:
    """A record's denoising work: steps x latent pixels x images, x2 with classifier-free guidance."""
    f = int(meta["shape"]["vae_scale_factor"])
    cfg = 2 if s["guidance_scale"] > 1 else 1
    return s["steps"] * (s["width"] // f) * (s["height"] // f) * s["num_images"] * cfg


def shape_batches(c: dict[str, list[Any]], rows: list[int], cap: int) -> list[list[int]]:
    """`rows` (staged positions, all of one shape) in batches of at most `cap` images (a record
    of more images than that runs alone)."""
    batches: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for i in rows:
        k = c["num_images"][i]
        if cur and n + k > cap:
            batches.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += k
    if cur:
        batches.append(cur)
    return batches


class GenerateImage(Task):
    name = "generate_image"
    options = GenerateImageOptions
    fields = ("prompt_field",)
    stage_schema = IMAGE_GEN_STAGE_SCHEMA
    summary_columns = ("record_id", "image_keys", "image_sha256")
    needs = ("model_index.json",)
    stages_files = True
    progress_unit = "steps"     # denoising steps x images

    def limits(self, runtime: Any, options: Any) -> tuple[int, bool]:
        return 0, False

    def stage(self, obj: Any, runtime: Any, records: Iterator[Any]) -> pa.Table:
        from batchinf.store import join

        opts = obj.options or GenerateImageOptions()
        prompt_field = (obj.input.prompt_field if obj.input is not None else None) or "prompt"
        images_uri = join(obj.output_uri, "images/") if obj.output_uri else None
        rows = StagedRows(IMAGE_GEN_STAGE_SCHEMA)
        for row, r, where in usable_records(obj, records, rows):
            s, code, msg = record_settings(r.fields or {}, opts, runtime.meta, r.record_id, prompt_field)
            if s is None:
                row.update(error=code, message=f"{where}: {msg}")
                continue
            row.update(n_tokens=work(s, runtime.meta), images_uri=images_uri,
                       response_format=(r.params or {}).get("response_format"), **s)
        return rows.table()

    def result_schema(self, meta: dict[str, Any], options: Any = None) -> pa.Schema:
        return IMAGE_GEN_SCHEMA

    def run(self, c: dict[str, list[Any]], runtime: Any, options: Any, check: Callable[[], None],
            split: Callable[[], bool] | None = None, files: Any = None) -> RunOutput:
        from batchinf.config import settings
        from batchinf.runtime.diffusion.runtime import ImageRequest

        if files is None:
            raise TypeError("generate_image stages its images: run it with files (parts.AttemptFiles)")
        valid = ok_rows(c)
        groups: dict[tuple[int, int, int, float], list[int]] = {}
        for i in valid:
            groups.setdefault((c["height"][i], c["width"][i], c["steps"][i], c["guidance_scale"][i]), []).append(i)
        budget = settings().max_kv_cache_bytes
        failures: dict[int, str] = {}
        written: dict[int, tuple[list[str], list[str], list[str]]] = {}
        digest = runtime.digest
        scheduler = runtime.meta["scheduler"]["class"]

        with ImageWriter(files, written) as writer:
            def run_batch(batch: list[int]) -> None:
                hit_record_failpoints([c["record_id"][i] for i in batch])
                check()
                h, w, steps, g = (c[k][batch[0]] for k in ("height", "width", "steps", "guidance_scale"))
                reqs = [ImageRequest(c["prompt"][i], c["negative_prompt"][i], c["seed"][i], c["num_images"][i])
                        for i in batch]
                images = runtime.denoise(reqs, width=w, height=h, steps=steps, guidance=g,
                                         on_step=lambda step: _step(runtime, sum(r.num_images for r in reqs), check,
                                                                    split))
                at = 0
                for i in batch:
                    k = c["num_images"][i]
                    writer.submit(i, c, images[at:at + k], digest, scheduler)
                    at += k

            for (h, w, steps, g), rows in groups.items():
                per_image = runtime.memory_bytes(1, w, h, g)
                cap = min(options.max_batch_images, budget // per_image)
                for batch in shape_batches(c, rows, max(cap, 1)):
                    need = per_image * sum(c["num_images"][i] for i in batch)
                    if need > budget:       # a record too big for this worker's memory alone
                        for i in batch:
                            failures[i] = (f"MemoryBudget: {c['num_images'][i]} images of {w}x{h} need about "
                                           f"{need >> 20} MiB of latents and activations, over this worker's budget "
                                           f"of {budget >> 20} MiB (BATCHINF_MAX_KV_CACHE_BYTES); lower num_images "
                                           "or the size")
                        continue
                    writer.one_batch_ahead()
                    isolate(run_batch, batch, done=writer.has, failed=failures.__setitem__)
        ok = [i for i in valid if i in written]
        fmt = c.get("response_format") or [None] * len(c["record_id"])
        table = pa.table({
            **record_columns(c, ok), "image_uris": [written[i][0] for i in ok],
            "image_keys": [written[i][1] for i in ok], "image_sha256": [written[i][2] for i in ok],
            **{k: [c[k][i] for i in ok] for k in ("width", "height", "seed", "steps", "guidance_scale", "num_images")},
            "scheduler": [scheduler] * len(ok), "response_format": [fmt[i] for i in ok],
        }, schema=IMAGE_GEN_SCHEMA)
        real = sum(c["n_tokens"][i] for i in ok)
        return RunOutput(table, failures, {"input": real, "output": sum(c["num_images"][i] for i in ok),
                                           "real": real, "padded": real})

    def planned_progress(self, staged: pa.Table | pa.RecordBatch) -> int | None:
        ok = pc.is_null(staged.column("error"))
        steps = pc.multiply(pc.cast(staged.column("steps"), pa.int64()), pc.cast(staged.column("num_images"), pa.int64()))
        return int(pc.sum(pc.filter(steps, ok)).as_py() or 0)

    def summarize(self, tables: Iterable[pa.Table]) -> dict[str, Any]:
        return {"images": sum(len(k) for t in tables for k in t.column("image_keys").to_pylist())}

    def output_files(self, tables: Iterable[pa.Table]) -> list[dict[str, Any]]:
        return [{"key": key, "kind": "image", "sha256": sha, "record_id": rid}
                for t in tables
                for rid, keys, shas in zip(t.column("record_id").to_pylist(), t.column("image_keys").to_pylist(),
                                           t.column("image_sha256").to_pylist())
                for key, sha in zip(keys, shas)]

    def detects(self, config: dict[str, Any], src: Path) -> bool:
        return (src / "model_index.json").is_file()

    def build_meta(self, src: Path, files: list[str], *, max_length: int | None, dtype: str) -> dict[str, Any]:
        from batchinf.tasks.diffusion_bundle import build_diffusion_meta

        return build_diffusion_meta(src, files, dtype=dtype, task=self.name)

    def open_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        from batchinf.runtime.diffusion.runtime import DiffusionRuntime

        return DiffusionRuntime(root, meta, device=device)

    def verify_inputs(self, runtime: Any) -> None:
        """Nothing is staged with the bundle's files (prompts are staged as text): nothing to check."""

    def verify_model(self, runtime: Any) -> None:
        from batchinf.tasks.diffusion_bundle import verify_diffusion_fixtures

        verify_diffusion_fixtures(runtime)


def _step(runtime: Any, images: int, check: Callable[[], None], split: Any = None) -> None:
    """After each denoising step: progress, then stop here if the job was cancelled (`JobStopped`:
    the attempt keeps the batches before this one) or the attempt lost its lease -- a batch stops
    at its next step, not at its end."""
    from batchinf import failpoints

    runtime.step_done(images)
    if failpoints.active():
        failpoints.hit("execute.image_step")
    check()
    if split is not None and getattr(split, "stop", None) is not None and split.stop():
        raise JobStopped("the job was cancelled")


class ImageWriter:
    """Encodes and stages records' images on two threads while the next batch denoises, at most
    one batch behind (`one_batch_ahead`): a slow store holds the device back instead of letting
    finished images pile up in memory. A write that fails raises out of the batch after it (or out
    of the `with`), so the attempt fails and is retried: storage, not the record, is at fault."""

    def __init__(self, files: Any, written: dict[int, tuple[list[str], list[str], list[str]]]) -> None:
        self.files, self.written = files, written
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="png")
        self.batches: list[list[tuple[int, Future]]] = [[]]    # oldest first; the last is the batch being formed

    def __enter__(self) -> "ImageWriter":
        return self

    def submit(self, i: int, c: dict[str, list[Any]], images: Any, digest: str, scheduler: str) -> None:
        """Encode and stage record `i`'s images (staged position `i`)."""
        self.batches[-1].append((i, self.pool.submit(_write_images, self.files, c, i, images, digest, scheduler)))

    def has(self, i: int) -> bool:
        """Whether record `i`'s images were denoised (their writes submitted)."""
        return i in self.written or any(j == i for b in self.batches for j, _ in b)

    def one_batch_ahead(self) -> None:
        """Before the next batch denoises: wait for every batch's writes but the last one's."""
        self._wait(len(self.batches) - 1)
        self.batches.append([])

    def _wait(self, n: int) -> None:
        for batch in self.batches[:n]:
            for i, fut in batch:
                self.written[i] = fut.result()
        del self.batches[:n]

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        try:
            if exc_type is None:
                self._wait(len(self.batches))
        finally:
            self.pool.shutdown(wait=True, cancel_futures=exc_type is not None)


def _write_images(files: Any, c: dict[str, list[Any]], i: int, images: Any, digest: str, scheduler: str
                  ) -> tuple[list[str], list[str], list[str]]:
    """Encode a record's images as PNG and stage them for their keys: (URIs under the output, keys, sha256s)."""
    from batchinf.runtime.diffusion.png import encode_png
    from batchinf.store import join

    rid = c["record_id"][i]
    text = {"prompt": c["prompt"][i], "seed": str(c["seed"][i]), "bundle_digest": digest, "record_id": rid,
            "settings": {k: c[k][i] for k in ("width", "height", "steps", "guidance_scale", "negative_prompt")}
            | {"scheduler": scheduler}}
    base = c["images_uri"][i]
    uris, keys, shas = [], [], []
    for k, img in enumerate(images):
        data = encode_png(img, {**text, "image_index": str(k)})
        key = image_key(rid, k)
        files.put(key, data)
        uris.append(join(base, key.removeprefix("images/")))
        keys.append(key)
        shas.append(hashlib.sha256(data).hexdigest())
    return uris, keys, shas
