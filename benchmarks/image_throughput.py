"""Task generate_image against two plain diffusers scripts on the same tiny random
StableDiffusionPipeline (tests/helpers/tiny_diffusion.py; no download) and the same mixed-size
prompts: images/s and denoising steps/s (one step of one image), side by side in one run:

    python benchmarks/image_throughput.py --threads 2 --records 96 --reps 3
    python benchmarks/image_throughput.py --short      # 12 records, 1 rep: CI runs it for correctness

- batchinf: the records as its plan orders them (by work: steps x latent pixels, so records of one
  shape sit together), run through the task's own `run` (batches of one latent shape of up to
  `--batch` images, one generator per record, PNGs encoded and written on threads);
- record by record: `pipe(prompt, generator=...)` per record, then its PNG;
- naive batcher: consecutive records of equal size, steps and guidance in input order batched (up
  to `--batch`), one generator per record, then their PNGs.

Each record has its own size (32 or 64 a side), steps (2-4) and seed. The three alternate (ABC
CBA ...) for `--reps` repetitions after one untimed warm-up each; medians are reported. Every
side's images are compared with batchinf's (uint8, after PNG): at most one level apart.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = ((32, 32), (64, 64), (32, 64), (64, 32))
WORDS = ("a", "cat", "dog", "red", "blue", "photo", "of", "the", "house", "tree", "sky", "small", "big")


def corpus(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w, h = SIZES[int(rng.integers(len(SIZES)))]
        out.append({"id": f"r{i}", "prompt": " ".join(rng.choice(WORDS, size=int(rng.integers(2, 7)))),
                    "width": w, "height": h, "steps": int(rng.integers(2, 5)), "guidance_scale": 7.5,
                    "seed": int(rng.integers(1 << 31))})
    return out


def png(image: np.ndarray) -> bytes:
    from PIL import Image

    from batchinf.runtime.diffusion.png import to_uint8

    buf = io.BytesIO()
    Image.fromarray(to_uint8(image)).save(buf, format="PNG")
    return buf.getvalue()


def decode(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--records", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8, help="images per batch (batchinf and the naive batcher)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per side, alternating")
    ap.add_argument("--short", action="store_true", help="12 records, 1 rep (CI: correctness, not timing)")
    ap.add_argument("--json", action="store_true", help="accepted for symmetry; the report is always JSON")
    args = ap.parse_args()
    if args.short:
        args.records, args.reps = 12, 1

    import torch

    from batchinf.parts import AttemptFiles, staged_file
    from batchinf.runtime.bundle import bundle_files
    from batchinf.runtime.diffusion.runtime import DiffusionRuntime
    from batchinf.tasks.diffusion_bundle import build_diffusion_meta
    from batchinf.tasks.generate_image import GenerateImage, GenerateImageOptions, record_settings, work
    from tests.helpers.tiny_diffusion import make_tiny_pipeline, reference_pipeline

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="image-bench-"))
    src = make_tiny_pipeline(tmp / "sd")
    meta = build_diffusion_meta(src, bundle_files(src), dtype="float32", task="generate_image")
    rt = DiffusionRuntime(src, meta)
    rt.load_model()
    pipe = reference_pipeline(src)
    records = corpus(args.records)
    opts = GenerateImageOptions(max_batch_images=args.batch)
    task = GenerateImage()
    staged = [record_settings(r, opts, meta, r["id"], "prompt")[0] for r in records]
    for s in staged:
        s["n_tokens"] = work(s, meta)
    order = sorted(range(len(records)), key=lambda i: (staged[i]["n_tokens"], i))   # the plan's staged order
    out_dir = tmp / "out"

    def ours() -> dict[str, bytes]:
        c: dict[str, list[Any]] = {k: [staged[i][k] for i in order] for k in staged[0]}
        c.update(record_id=[records[i]["id"] for i in order], source=["bench"] * len(order),
                 ordinal=list(order), error=[None] * len(order), message=[None] * len(order),
                 images_uri=[out_dir.as_uri() + "/"] * len(order))
        part = (out_dir / "part.parquet").as_uri()
        run = task.run(c, rt, opts, lambda: None, files=AttemptFiles(part, 1))   # images staged as an attempt's
        assert not run.failures, run.failures
        return {r["record_id"]: Path(staged_file(part, r["image_keys"][0]).removeprefix("file://")).read_bytes()
                for r in run.table.to_pylist()}

    def call(batch: list[dict[str, Any]]) -> np.ndarray:
        r0 = batch[0]
        return pipe(prompt=[r["prompt"] for r in batch], width=r0["width"], height=r0["height"],
                    num_inference_steps=r0["steps"], guidance_scale=r0["guidance_scale"],
                    generator=[torch.Generator().manual_seed(r["seed"]) for r in batch], output_type="np").images

    def one_by_one() -> dict[str, bytes]:
        return {r["id"]: png(call([r])[0]) for r in records}

    def naive() -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        batch: list[dict[str, Any]] = []

        def flush() -> None:
            for r, img in zip(batch, call(batch)):
                out[r["id"]] = png(img)
            batch.clear()

        for r in records:
            key = lambda x: (x["width"], x["height"], x["steps"], x["guidance_scale"])  # noqa: E731
            if batch and (key(batch[0]) != key(r) or len(batch) == args.batch):
                flush()
            batch.append(r)
        if batch:
            flush()
        return out

    sides = {"batchinf": ours, "record_by_record": one_by_one, "naive_batcher": naive}
    images = {name: fn() for name, fn in sides.items()}           # warm-up (untimed) and the images
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.reps):
        for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
    ref = {k: decode(v) for k, v in images["batchinf"].items()}
    diff = {name: int(max(np.abs(decode(v).astype(int) - ref[k].astype(int)).max() for k, v in imgs.items()))
            for name, imgs in images.items()}
    steps = sum(r["steps"] for r in records)
    median = {k: float(np.median(v)) for k, v in times.items()}
    report = {
        "records": len(records), "images": len(records), "denoising_steps": steps, "threads": args.threads,
        "batch": args.batch, "reps": args.reps,
        "shapes": len({(r["width"], r["height"], r["steps"]) for r in records}),
        **{name: {"seconds_median": round(median[name], 2), "seconds": [round(t, 2) for t in times[name]],
                  "images_per_s": round(len(records) / median[name], 2), "steps_per_s": round(steps / median[name], 1)}
           for name in sides},
        "speedup_vs_record_by_record": round(median["record_by_record"] / median["batchinf"], 2),
        "speedup_vs_naive_batcher": round(median["naive_batcher"] / median["batchinf"], 2),
        "max_uint8_diff_vs_batchinf": diff,
    }
    print(json.dumps(report, indent=1))
    if max(diff.values()) > 1:
        sys.exit(f"images differ by more than one level: {diff}")


if __name__ == "__main__":
    main()
