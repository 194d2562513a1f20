"""Task generate_image end to end on the embedded default, on the tiny random pipeline: images
equal to diffusers' own for each record (its seed, or one derived from the job and its id), PNG
text chunks, result rows, the images listed in _MANIFEST.json and re-verified, each bad record an
error row naming the field, split vs unsplit and a rerun byte-identical, a mixed-size shard
denoised in batches of one shape each, limits refused at submit, cancel mid-denoise."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchinf.bundles import import_bundle, open_runtime
from batchinf.controller import cancel, drive
from batchinf.errors import ManifestError
from batchinf.ledger.states import JobStatus
from batchinf.manifest import parse_manifest
from batchinf.runtime.diffusion.png import png_text, to_uint8
from batchinf.runtime.generation.sampling import derive_seed
from batchinf.submit import submit
from batchinf.verify import MANIFEST, PARTIAL, SUCCESS, verify_output
from tests.helpers.env import OPERATOR
from tests.helpers.tiny_diffusion import cached_pipeline, reference_images, reference_pipeline

pytestmark = pytest.mark.integration

GOOD = [
    {"id": "a", "prompt": "a red cat", "width": 32, "height": 32, "seed": 1},
    {"id": "b", "prompt": "blue sky", "width": 64, "height": 32, "seed": 2},
    {"id": "c", "prompt": "a big tree", "negative_prompt": "small", "width": 32, "height": 32, "seed": 3},
    {"id": "d", "prompt": "the house", "width": 32, "height": 32, "steps": 3, "seed": 4, "num_images": 2},
    {"id": "e", "prompt": "a small dog", "width": 32, "height": 64, "guidance_scale": 1.0},   # no seed: derived
    {"id": "f", "prompt": "red house", "width": 64, "height": 32, "seed": 6},
]
BAD = [
    ({"id": "x1", "prompt": "  "}, "empty_prompt", "prompt"),
    ({"id": "x2", "prompt": "p", "width": 30, "height": 32}, "invalid_size", "width 30"),
    ({"id": "x3", "prompt": "p", "steps": 1000}, "invalid_steps", "options.max_steps 100"),
    ({"id": "x4", "prompt": "p", "num_images": 0}, "invalid_num_images", "num_images 0"),
    ({"id": "x5", "prompt": "p", "seed": -1}, "invalid_seed", "seed -1"),
    ({"id": "x6", "prompt": "p", "guidance_scale": "high"}, "invalid_guidance_scale", "guidance_scale"),
    ({"id": "x7", "prompt": "p", "width": 2048, "height": 2048}, "too_many_pixels", "options.max_pixels"),
    ({"id": "x8", "prompt": 42}, "invalid_prompt", "string"),
]
OPTIONS = {"steps": 2, "seed": 99, "max_batch_images": 3}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_pipeline(tmp_path_factory.mktemp("tiny-diffusion"), "pndm")


def _write(dir: Path, records: list[dict]) -> str:
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(dir) + "/"


def _manifest(inp: str, out: Path, **extra: object) -> dict:
    return {"name": "images", "task": "generate_image", "bundle": "sd@prod", "output": {"uri": str(out)},
            "input": {"uri": inp, "format": "jsonl"}, "options": dict(OPTIONS), **extra}


def _run(inp: str, out: Path, **extra: object) -> str:
    job_id, _ = submit(parse_manifest(_manifest(inp, out, **extra)), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
    return job_id


def _rows(out: Path) -> dict[str, dict]:
    return {r["record_id"]: r for r in pq.read_table(out, ignore_prefixes=["_", "errors", "images", "openai"]).to_pylist()}


def test_generate_image_job(tmp_path: Path, bi_home: Path, pipeline: Path) -> None:
    from PIL import Image

    digest = import_bundle(pipeline, "sd", alias="prod").digest
    inp = _write(tmp_path / "in", GOOD[:3] + [b for b, _, _ in BAD[:4]] + GOOD[3:] + [b for b, _, _ in BAD[4:]])
    out = tmp_path / "out"
    _run(inp, out)
    errs = {e["record_id"]: e for e in pq.read_table(out / "errors").to_pylist()}
    assert {k: e["error"] for k, e in errs.items()} == {b["id"]: code for b, code, _ in BAD}
    for b, _, needle in BAD:
        assert needle in errs[b["id"]]["message"] and repr(b["id"]) in errs[b["id"]]["message"]

    rows = _rows(out)
    assert sorted(rows) == [r["id"] for r in GOOD]
    assert rows["e"]["seed"] == derive_seed(99, "e") and rows["a"]["seed"] == 1
    assert rows["d"]["num_images"] == 2 and len(rows["d"]["image_uris"]) == 2 and rows["d"]["steps"] == 3
    ref = reference_pipeline(pipeline)
    man = json.loads((out / MANIFEST).read_text())
    listed = {f["key"]: f for f in man["files"]}
    assert man["counts"]["images"] == len(listed) == 7
    for r in GOOD:
        row = rows[r["id"]]
        want = reference_images(ref, [{**r, "seed": row["seed"]}], width=r["width"], height=r["height"],
                                num_inference_steps=r.get("steps", 2), guidance_scale=r.get("guidance_scale", 7.5))
        for k, (key, sha) in enumerate(zip(row["image_keys"], row["image_sha256"])):
            data = (out / key).read_bytes()
            assert listed[key] == {"key": key, "kind": "image", "sha256": sha, "record_id": r["id"]}
            img = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            assert img.shape == (r["height"], r["width"], 3)
            # diffusers' image within 1e-5 before rounding: at most one level apart after it
            assert np.abs(img.astype(int) - to_uint8(want[k]).astype(int)).max() <= 1
            text = png_text(data)
            assert text["prompt"] == r["prompt"] and text["seed"] == str(row["seed"])
            assert text["bundle_digest"] == digest and json.loads(text["settings"])["steps"] == row["steps"]
    assert verify_output(str(out))["files"] == 7

    # split into one record per shard, and run again: every image byte-identical
    out2 = tmp_path / "out2"
    _run(inp, out2, shards={"max_records": 1})
    assert json.loads((out2 / MANIFEST).read_text())["shards"]["total"] >= len(GOOD)
    assert {k: r["image_sha256"] for k, r in _rows(out2).items()} == {k: r["image_sha256"] for k, r in rows.items()}
    (out / next(iter(listed))).write_bytes(b"tampered")
    with pytest.raises(Exception, match="sha256"):
        verify_output(str(out))


def test_a_mixed_shard_denoises_one_shape_per_batch(tmp_path: Path, bi_home: Path, pipeline: Path) -> None:
    from batchinf.tasks import get_task
    from batchinf.tasks.generate_image import GenerateImageOptions, record_settings, work

    digest = import_bundle(pipeline, "sd").digest
    rt = open_runtime(digest)
    task, opts = get_task("generate_image"), GenerateImageOptions(steps=2, max_batch_images=2)
    records = GOOD + [{"id": f"g{i}", "prompt": "a cat", "width": 32, "height": 32, "seed": i} for i in range(3)]
    staged = [record_settings(r, opts, rt.meta, r["id"], "prompt")[0] for r in records]
    c = {k: [s[k] for s in staged] for k in staged[0]}
    c.update(record_id=[r["id"] for r in records], source=["s"] * len(records), ordinal=list(range(len(records))),
             error=[None] * len(records), message=[None] * len(records),
             n_tokens=[work(s, rt.meta) for s in staged], images_uri=[(tmp_path / "imgs").as_uri() + "/"] * len(records))
    shapes: list[tuple] = []
    denoise = rt.denoise

    def spy(reqs, **kw):        # the real runtime, each batch's shape noted
        shapes.append((kw["width"], kw["height"], kw["steps"], kw["guidance"], sum(r.num_images for r in reqs)))
        return denoise(reqs, **kw)

    rt.denoise = spy
    try:
        run = task.run(c, rt, opts, lambda: None)
    finally:
        del rt.denoise
    assert run.table.num_rows == len(records) and not run.failures
    assert sorted({s[:4] for s in shapes}) == [(32, 32, 2, 7.5), (32, 32, 3, 7.5), (32, 64, 2, 1.0), (64, 32, 2, 7.5)]
    assert all(n <= 2 for *_, n in shapes) and len(shapes) == 6     # 4 same-shape records: 2 batches
    # work is steps x latent pixels x images, doubled with guidance > 1
    assert work(staged[0], rt.meta) == 2 * 16 * 16 * 2 and work(staged[4], rt.meta) == 2 * 16 * 32


def test_limits_are_refused_at_submit(tmp_path: Path, bi_home: Path, pipeline: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import_bundle(pipeline, "sd", alias="prod")
    inp = _write(tmp_path / "in", GOOD[:1])
    for opts, match in (({"max_steps": 500}, "options.max_steps 500 is over the limit image_steps = 200"),
                        ({"max_pixels": 1 << 30}, "over the limit image_pixels"),
                        ({"num_images": 17, "max_images": 17}, "over the limit images_per_record = 16")):
        with pytest.raises(ManifestError, match=match):
            submit(parse_manifest({**_manifest(inp, tmp_path / "o"), "options": opts}), OPERATOR)


def _computing(job_id: str) -> bool:
    from sqlalchemy import select

    from batchinf.ledger.db import tx
    from batchinf.ledger.tables import shards

    with tx() as conn:
        return bool(conn.execute(select(shards.c.id).where(shards.c.job_id == job_id,
                                                           shards.c.status == "running")).first())


def test_cancel_stops_a_batch_mid_denoise(tmp_path: Path, bi_home: Path, pipeline: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import_bundle(pipeline, "sd", alias="prod")
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.image_step=sleep(0.2)")
    inp = _write(tmp_path / "in", [{"id": f"r{i}", "prompt": "a cat", "width": 32, "height": 32, "seed": i,
                                    "steps": 40} for i in range(4)])
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(_manifest(inp, out, options={"steps": 40, "max_batch_images": 4})), OPERATOR)
    done: list[str] = []
    t = threading.Thread(target=lambda: done.append(drive(job_id, workers=1, threads=1)))
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not _computing(job_id):
        time.sleep(0.1)
    time.sleep(1.0)             # a few steps into the batch's 40 (8 s)
    t0 = time.monotonic()
    cancel(job_id)
    t.join(60)
    assert done == [JobStatus.CANCELLED]
    assert time.monotonic() - t0 < 8, "a cancelled batch stops at its next step, not after its 40"
    assert not (out / SUCCESS).exists() and not (out / MANIFEST).exists()
    partial = json.loads((out / PARTIAL).read_text())
    # what finished before the cancel is kept (committed), the batch it stopped is not
    c = partial["counts"]
    assert partial["status"] == "cancelled" and c["records_done"] < 4 and c["records_done"] + c["records_not_done"] == 4


def test_openai_image_lines(tmp_path: Path, bi_home: Path, pipeline: Path) -> None:
    """/v1/images/generations lines (prompt, n, size, response_format) run as the same records;
    the openai/ output has OpenAI's images body: URLs of the PNGs, or the PNGs as base64."""
    import base64

    import_bundle(pipeline, "sd", alias="prod")
    url = "/v1/images/generations"
    lines = [{"custom_id": "u", "method": "POST", "url": url, "body": {"prompt": "a red cat", "size": "32x32"}},
             {"custom_id": "b", "method": "POST", "url": url,
              "body": {"prompt": "blue sky", "n": 2, "size": "64x32", "response_format": "b64_json", "model": "sd"}},
             {"custom_id": "q", "method": "POST", "url": url, "body": {"prompt": "x", "quality": "hd"}},
             {"custom_id": "s", "method": "POST", "url": url, "body": {"prompt": "x", "size": "big"}},
             {"custom_id": "w", "method": "POST", "url": url, "body": {"prompt": "x", "size": "30x32"}},
             {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "batch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    m = _manifest(str(tmp_path / "in") + "/", out)
    m["input"]["format"] = "openai-batch"
    job_id, _ = submit(parse_manifest(m), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
    got = {}
    for f in sorted((out / "openai").iterdir()):
        for line in f.read_text().splitlines():
            got[json.loads(line)["custom_id"]] = json.loads(line)
    assert {k: v["error"]["code"] for k, v in got.items() if v["error"]} == {
        "q": "unsupported_parameter", "s": "invalid_parameter", "w": "invalid_size", "c": "endpoint_mismatch"}
    rows = _rows(out)
    body = got["u"]["response"]["body"]
    assert body["data"] == [{"url": rows["u"]["image_uris"][0]}] and rows["u"]["width"] == 32
    b64 = got["b"]["response"]["body"]["data"]
    assert len(b64) == 2 and rows["b"]["num_images"] == 2 and (rows["b"]["width"], rows["b"]["height"]) == (64, 32)
    assert [base64.b64decode(d["b64_json"]) for d in b64] == [(out / k).read_bytes() for k in rows["b"]["image_keys"]]
    assert verify_output(str(out))["ok"]        # the openai/ files are what the parts render to
