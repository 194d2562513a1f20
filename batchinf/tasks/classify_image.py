"""Task classify_image: a record's image -> `label`, `score` and `top`, as task classify gives
for text. The image (`input.image_field`) is bytes (a Parquet binary column) or an object URI,
which is pinned (ETag / version) and read like any input object, within the tenant's grants for a
confined job. At plan time each image is decoded under a pixel limit and resized / cropped as the
bundle's preprocessor_config.json says; the staged uint8 pixels are rescaled, normalized and run
at execute. Length measure: the preprocessed image's pixels (one bucket for a fixed-size ViT).
Bad images are error rows: image_too_large, bad_image, missing_image, invalid_image,
image_unreachable (missing, changed or unreadable URI) and image_forbidden (outside the grants)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
from pydantic import Field

from batchinf.errors import InputError
from batchinf.manifest_rules import MAX_LABELS, POSITIVE, Section, choice, positive
from batchinf.tasks.base import RECORD_FIELDS, STAGE_FIELDS, RunOutput, StagedRows, Task, ok_rows, record_columns, usable_records
from batchinf.tasks.batching import run_units
from batchinf.tasks.classify import TOP, Classify, top_labels
from batchinf.tasks.embed import DEVICES

IMAGE_STAGE_SCHEMA = pa.schema(STAGE_FIELDS + [
    ("pixels", pa.binary()), ("height", pa.int32()), ("width", pa.int32()),     # preprocessed uint8 HxWx3
    ("image_sha256", pa.string()), ("image_width", pa.int32()), ("image_height", pa.int32()),
])
CLASSIFY_IMAGE_SCHEMA = pa.schema(RECORD_FIELDS + [
    ("label", pa.string()), ("score", pa.float32()), ("top", TOP),
    ("image_sha256", pa.string()), ("image_width", pa.int32()), ("image_height", pa.int32()),
])
MAX_IMAGE_BYTES = 64 << 20      # an image object larger than this is not read
# An input object's staged table is built in memory: its preprocessed pixels (3 x H x W bytes per
# image, 150 KB at 224x224) may not exceed this.
MAX_STAGED_BYTES = 2 << 30


class ClassifyImageOptions(Section):
    """Options of task classify_image."""
    max_pixels: Annotated[int, POSITIVE] = Field(
        40_000_000, description="images whose header declares more pixels are image_too_large error rows "
                                "(checked before decoding: decompression bombs cost nothing)")
    max_batch_images: Annotated[int, positive(4096)] = Field(32, description="images per forward batch")
    top_k: Annotated[int, positive(MAX_LABELS)] = Field(5, description="labels listed in `top`, best first (at most all)")
    device: Annotated[str, choice(DEVICES)] = "auto"


def _image_bytes(value: Any, obj: Any) -> bytes:
    """The record's image: its bytes, or the pinned content of the object its URI names."""
    from batchinf.runtime.images import ImageProblem
    from batchinf.tasks.objects import RecordObjectProblem, record_object

    try:
        return record_object(value, obj, "image", MAX_IMAGE_BYTES)
    except RecordObjectProblem as exc:
        raise ImageProblem(exc.code, str(exc)) from None


class ClassifyImage(Task):
    name = "classify_image"
    options = ClassifyImageOptions
    fields = ("image_field",)
    stage_schema = IMAGE_STAGE_SCHEMA
    summary_columns = ("label",)
    needs = ("config.json", "preprocessor_config.json")

    def limits(self, runtime: Any, options: Any) -> tuple[int, bool]:
        return 0, False

    def stage(self, obj: Any, runtime: Any, records: Iterator[Any]) -> pa.Table:
        from batchinf.runtime.images import ImageProblem, decode

        name = obj.input.image_field or "image"
        max_pixels = obj.options.max_pixels
        rows = StagedRows(IMAGE_STAGE_SCHEMA)
        staged = 0
        for row, r, where in usable_records(obj, records, rows):
            value = (r.fields or {}).get(name)
            try:
                if value is None:
                    raise ImageProblem("missing_image", f"has no image field {name!r} (set input.image_field "
                                                        "if it has another name)")
                data = _image_bytes(value, obj)
                img = decode(data, max_pixels)
                px = runtime.preprocessor.to_pixels(img)
            except ImageProblem as exc:
                row.update(error=exc.code, message=f"{where}: image {exc}")
                continue
            staged += px.nbytes
            if staged > MAX_STAGED_BYTES:
                raise InputError(f"{obj.pin.uri}: its images preprocess to more than {MAX_STAGED_BYTES >> 20} MiB "
                                 f"(at record {r.record_id!r}); split it into smaller objects "
                                 f"(of at most {MAX_STAGED_BYTES // px.nbytes} images of this model)")
            row.update(pixels=px.tobytes(), height=px.shape[0], width=px.shape[1], n_tokens=px.shape[0] * px.shape[1],
                       image_sha256=hashlib.sha256(data).hexdigest(), image_width=img.size[0],
                       image_height=img.size[1])
        return rows.table()

    def result_schema(self, meta: dict[str, Any], options: Any = None) -> pa.Schema:
        return CLASSIFY_IMAGE_SCHEMA

    def run(self, c: dict[str, list[Any]], runtime: Any, options: Any, check: Callable[[], None],
            split: Callable[[], bool] | None = None, files: Any = None) -> RunOutput:
        from batchinf.runtime.classifier import activate

        valid = ok_rows(c)

        def forward(units: list[int]) -> tuple[np.ndarray, int]:
            check()
            i = [valid[u] for u in units]
            px = np.stack([np.frombuffer(c["pixels"][k], np.uint8).reshape(c["height"][k], c["width"][k], 3)
                           for k in i])
            return runtime.logits(px), len(i) * max(c["n_tokens"][k] for k in i)

        # one unit per image, all of one size: batches of max_batch_images
        out = run_units(forward, [1] * len(valid), list(range(len(valid))), [c["record_id"][i] for i in valid],
                        options.max_batch_images)
        failures = {valid[u]: msg for u, msg in out.failures.items()}
        done = [u for u in range(len(valid)) if u in out.vectors]
        ok = [valid[u] for u in done]
        labels = runtime.meta["labels"]
        probs = activate(np.stack([out.vectors[u] for u in done]), runtime.meta["activation"]) if done \
            else np.zeros((0, len(labels)), np.float32)
        top = top_labels(probs, labels, min(options.top_k, len(labels)))
        table = pa.table({
            **record_columns(c, ok), "label": [t[0]["label"] for t in top], "score": [t[0]["score"] for t in top],
            "top": top, **{k: [c[k][i] for i in ok] for k in ("image_sha256", "image_width", "image_height")},
        }, schema=CLASSIFY_IMAGE_SCHEMA)
        real = sum(c["n_tokens"][i] for i in ok)
        return RunOutput(table, failures, {"input": real, "output": 0, "real": real, "padded": out.padded})

    def summarize(self, tables: Iterable[pa.Table]) -> dict[str, Any]:
        return Classify().summarize(tables)

    def detects(self, config: dict[str, Any], src: Path) -> bool:
        from batchinf.runtime.vit import ARCHITECTURES

        return any(a in ARCHITECTURES for a in config.get("architectures") or ())

    def build_meta(self, src: Path, files: list[str], *, max_length: int | None, dtype: str) -> dict[str, Any]:
        from batchinf.tasks.image_bundle import build_image_meta

        return build_image_meta(src, files, task=self.name, dtype=dtype)

    def open_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        from batchinf.runtime.vit import ImageRuntime

        return ImageRuntime(root, meta, device=device)

    def verify_inputs(self, runtime: Any) -> None:
        from batchinf.tasks.image_bundle import verify_pixel_fixtures

        verify_pixel_fixtures(runtime)

    def verify_model(self, runtime: Any) -> None:
        from batchinf.tasks.image_bundle import verify_image_logits

        verify_image_logits(runtime)
