"""generate_image's ImageWriter: PNGs encoded and staged (parts.AttemptFiles, the real local
store) on threads while the next batch denoises, at most one batch behind, and a write that
fails fails the run instead of becoming the record's error. Failpoints on the staged files
(`execute.file[a1:N]`) slow or break the N-th write."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from batchinf import failpoints
from batchinf.parts import AttemptFiles, staged_file
from batchinf.tasks.generate_image import ImageWriter, image_key

IMAGE = np.full((1, 8, 8, 3), 0.5, dtype=np.float32)      # one 8x8 image


@pytest.fixture
def points(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def set_points(spec: str) -> None:
        monkeypatch.setenv("BATCHINF_FAILPOINTS", spec)
        failpoints.reload()

    yield set_points
    monkeypatch.delenv("BATCHINF_FAILPOINTS", raising=False)
    failpoints.reload()


def _columns(tmp_path: Path, n: int) -> dict[str, list[Any]]:
    return {"record_id": [f"r{i}" for i in range(n)], "prompt": ["a cat"] * n, "seed": list(range(n)),
            "width": [8] * n, "height": [8] * n, "steps": [2] * n, "guidance_scale": [7.5] * n,
            "negative_prompt": [None] * n, "images_uri": [(tmp_path / "out" / "images").as_uri() + "/"] * n}


def test_writes_run_at_most_one_batch_behind(tmp_path: Path, points: Any) -> None:
    # each of the first two images takes 0.6 s to stage (N counts writes as they finish, on two threads)
    points("execute.file[a1:1]=sleep(0.6);execute.file[a1:2]=sleep(0.6)")
    part = (tmp_path / "a1" / "part.parquet").as_uri()
    c, written = _columns(tmp_path, 3), {}
    with ImageWriter(AttemptFiles(part, 1), written) as w:
        w.one_batch_ahead()
        w.submit(0, c, IMAGE, "sha256:x", "PNDMScheduler")
        t0 = time.monotonic()
        w.one_batch_ahead()                 # batch 2 denoises while batch 1's image is staged
        assert time.monotonic() - t0 < 0.3 and 0 not in written
        w.submit(1, c, IMAGE, "sha256:x", "PNDMScheduler")
        w.one_batch_ahead()                 # batch 3 waits until batch 1's image is staged
        assert 0 in written and time.monotonic() - t0 >= 0.5
        w.submit(2, c, IMAGE, "sha256:x", "PNDMScheduler")
    assert sorted(written) == [0, 1, 2]
    uris, keys, shas = written[1]
    assert keys == [image_key("r1", 0)] and uris == [(tmp_path / "out" / keys[0]).as_uri()]
    assert Path(staged_file(part, keys[0]).removeprefix("file://")).is_file()
    assert not (tmp_path / "out").exists(), "images are staged beside the attempt's part, not in the output"


def test_a_failed_write_fails_the_run(tmp_path: Path, points: Any) -> None:
    points("execute.file[a1:1]=raise;execute.file[a1:2]=raise")     # both writes fail, whichever ends first
    c = _columns(tmp_path, 2)
    with pytest.raises(failpoints.FailpointError, match=r"execute.file\[a1:[12]\]"):
        with ImageWriter(AttemptFiles((tmp_path / "a1" / "part.parquet").as_uri(), 1), {}) as w:
            w.one_batch_ahead()
            w.submit(0, c, IMAGE, "sha256:x", "PNDMScheduler")
            w.one_batch_ahead()
            w.submit(1, c, IMAGE, "sha256:x", "PNDMScheduler")
            w.one_batch_ahead()             # batch 1's write failed: raised here, before batch 3 runs
            pytest.fail("a batch ran after a failed write")
