"""Task generate_image end to end on the embedded default, on the tiny random pipeline: images
equal to diffusers' own for each record (its seed, or one derived from the job and its id), PNG
text chunks, result rows, the images listed in _MANIFEST.json and re-verified, each bad record an
error row naming the field, split vs unsplit within one uint8 level, a mixed-size shard
denoised in batches of one shape each, limits refused at submit, cancel mid-denoise; images staged
under _work/ until publish (none in images/ while running, after a failure, or of a stopped
batch), each staged image checked at publish, a retry after a killed attempt byte-identical,
progress in denoising steps."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from batchinf.bundles import import_bundle, open_runtime
from batchinf.controller import cancel, drive
from batchinf.errors import ManifestError, VerificationError
from batchinf.ledger.states import JobStatus
from batchinf.manifest import parse_manifest
from batchinf.parts import AttemptFiles
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

    # split into one record per shard, and run again: every image the same up to the float
    # tolerance of another batch size (a value 1e-6 from a rounding boundary may flip one uint8
    # level, so the bytes may differ; a retry in the same batches is byte-identical:
    # test_a_retried_shard_publishes_byte_identical_images)
    out2 = tmp_path / "out2"
    _run(inp, out2, shards={"max_records": 1})
    assert json.loads((out2 / MANIFEST).read_text())["shards"]["total"] >= len(GOOD)
    split = _rows(out2)
    assert sorted(split) == sorted(rows)
    for rid, row in rows.items():
        for key in row["image_keys"]:
            a, b = (np.asarray(Image.open(o / key).convert("RGB")).astype(int) for o in (out, out2))
            assert np.abs(a - b).max() <= 1, f"record {rid}: split and unsplit images differ beyond rounding"
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
        run = task.run(c, rt, opts, lambda: None, files=AttemptFiles((tmp_path / "a1" / "part.parquet").as_uri(), 1))
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
    # like the parts, only the done shards' images are published: none of the stopped batch's
    assert sorted(_images(out)) == sorted(Path(f["key"]).name for f in partial.get("files", []))


def _images(out: Path) -> dict[str, bytes]:
    """The files under the output's images/, by name."""
    d = out / "images"
    return {f.name: f.read_bytes() for f in sorted(d.iterdir())} if d.exists() else {}


def test_progress_counts_denoising_steps_and_images_wait_for_publish(tmp_path: Path, bi_home: Path, pipeline: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """While the job runs its status counts denoising steps x images as the running attempt's
    heartbeats report them (0 < done < planned), and nothing is under the output's images/ (the
    attempt stages its images under _work/); at the end done == planned, in `status --json` too,
    and images/ holds exactly the listed images."""
    from click.testing import CliRunner

    from batchinf.cli import main
    from batchinf.ledger.status import status

    import_bundle(pipeline, "sd", alias="prod")
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.image_step=sleep(0.1)")
    monkeypatch.setenv("BATCHINF_HEARTBEAT_SECONDS", "0.2")
    records = [{"id": f"r{i}", "prompt": "a cat", "width": 32, "height": 32, "seed": i, "num_images": 1 + i % 2}
               for i in range(4)] + [BAD[0][0]]
    planned = 6 * (1 + 2 + 1 + 2)           # steps x images of the valid records; the bad one has none
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(_manifest(_write(tmp_path / "in", records), out,
                                                options={"steps": 6, "max_batch_images": 2})), OPERATOR)
    done: list[str] = []
    t = threading.Thread(target=lambda: done.append(drive(job_id, workers=1, threads=1)))
    t.start()
    seen: list[int] = []
    while t.is_alive():
        # names only, listed before the status is read (while it was running, or earlier); publish
        # may be renaming a staged image into images/ right now, so nothing is opened here
        early = [f.name for f in (out / "images").glob("*")] if (out / "images").exists() else []
        st = status(job_id)
        if st["status"] == JobStatus.RUNNING:
            assert not early, f"images under images/ while the job runs: {sorted(early)}"
            assert st["progress"]["steps_planned"] == planned
            seen.append(st["progress"]["steps_done"])
        time.sleep(0.05)
    assert done == [JobStatus.SUCCEEDED]
    assert any(0 < n < planned for n in seen), f"no progress seen between 0 and {planned}: {seen}"
    assert seen == sorted(seen), "steps done never go back"
    r = CliRunner().invoke(main, ["status", job_id, "--json"])
    assert r.exit_code == 0, r.output
    progress = json.loads(r.output)["progress"]
    assert (progress["steps_done"], progress["steps_planned"]) == (planned, planned)
    man = json.loads((out / MANIFEST).read_text())
    assert sorted(Path(f["key"]).name for f in man["files"]) == sorted(_images(out)) and len(man["files"]) == 6
    assert not (out / "_work").exists()


def test_a_failed_job_leaves_no_images(tmp_path: Path, bi_home: Path, pipeline: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every attempt stages its images and then fails before its commit: the job fails, and the
    output holds no images/ (what the attempts staged stays under _work/ with their parts)."""
    import_bundle(pipeline, "sd", alias="prod")
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.before_commit=raise")
    monkeypatch.setenv("BATCHINF_MAX_ATTEMPTS", "1")
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(_manifest(_write(tmp_path / "in", GOOD[:2]), out)), OPERATOR)
    assert drive(job_id, workers=1, threads=1) == JobStatus.FAILED
    assert list(out.glob("_work/**/files/images/*.png")), "the attempts staged their images"
    assert not (out / "images").exists() and not (out / SUCCESS).exists()


def test_a_retried_shard_publishes_byte_identical_images(tmp_path: Path, bi_home: Path, pipeline: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard's first attempt dies with its worker process (as by kill -9) after staging 3 of
    its 5 images (execute.file[a1:3]=crash); the second attempt, on the same worker type, commits,
    and the published images are byte for byte those of a run that was never retried."""
    from sqlalchemy import select

    from batchinf.ledger.db import tx
    from batchinf.ledger.tables import attempts, shards

    import_bundle(pipeline, "sd", alias="prod")
    records = [{"id": f"r{i}", "prompt": f"a cat number {i}", "width": 32, "height": 32, "seed": i}
               for i in range(5)]
    inp = _write(tmp_path / "in", records)
    clean, retried = tmp_path / "clean", tmp_path / "retried"
    _run(inp, clean)
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "execute.file[a1:3]=crash")
    job_id = _run(inp, retried)
    with tx() as conn:
        outcomes = conn.execute(select(attempts.c.number, attempts.c.status)
                                .join(shards, shards.c.id == attempts.c.shard_id)
                                .where(shards.c.job_id == job_id, shards.c.bucket >= 0)
                                .order_by(attempts.c.number)).all()
    assert [tuple(o) for o in outcomes] == [(1, "lost"), (2, "committed")]
    assert len(_images(clean)) == 5 and _images(retried) == _images(clean)
    assert verify_output(str(retried))["files"] == 5
    assert not (retried / "_work").exists()
    (retried / "images" / "stray.png").write_bytes(b"not published by the job")
    with pytest.raises(VerificationError, match="stray.png is not listed"):
        verify_output(str(retried))


def test_publish_checks_each_staged_image(tmp_path: Path, bi_home: Path, pipeline: Path) -> None:
    """A committed shard's staged image that changed before publish fails verification naming the
    record and the staged object, and nothing is copied to images/ (parts neither)."""
    from batchinf.execute import execute_shard
    from batchinf.ledger import leases, shards
    from batchinf.ledger.jobs import get as job_row
    from batchinf.parts import staged_file
    from batchinf.tasks.generate_image import image_key
    from tests.helpers.stages import plan_job, publish_job

    import_bundle(pipeline, "sd", alias="prod")
    out = tmp_path / "out"
    job_id, _ = submit(parse_manifest(_manifest(_write(tmp_path / "in", GOOD[:2]), out)), OPERATOR)
    plan_job(job_id)
    shards.dispatch_ready(job_id)
    parts = []
    while (lease := leases.claim_next([job_id], "test:1", 60)) is not None:
        parts.append(execute_shard(lease).output_uri)
    staged = next(f for f in (Path(staged_file(p, image_key("b", 0)).removeprefix("file://")) for p in parts)
                  if f.exists())
    staged.write_bytes(staged.read_bytes() + b"\0")
    assert shards.verify_when_done(job_id)
    with pytest.raises(VerificationError, match=r"image of record 'b'.*the staged file changed") as err:
        publish_job(job_id)
    assert str(staged) in str(err.value)
    assert not (out / "images").exists() and not list(out.glob("part-*"))
    assert job_row(job_id).status == JobStatus.VERIFYING


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
