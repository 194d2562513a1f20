"""A worker that cannot open the bundle on the requested device: `--device cuda` on a host without
CUDA is refused up front by `batchinf run` and `batchinf worker`; a worker that opens a bundle on
cuda anyway fails its attempt with a clear, retryable message (another worker of a mixed fleet may
have CUDA). A manifest asking for cuda routes its job to cuda workers (jobs.device): `batchinf run`
on a host without CUDA refuses it up front, naming the fix, and leaves the job to a GPU worker
instead of failing it or waiting forever."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchinf.errors import DeviceUnavailableError
from batchinf.retry_policy import Outcome, classify
from tests.helpers.corpus import manifest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
MESSAGE = "device cuda requested but this worker has no CUDA; use --device cpu or auto"


def test_open_runtime_refuses_cuda_with_a_retryable_error(tiny_bundle: str) -> None:
    from batchinf.bundles import open_runtime

    with pytest.raises(DeviceUnavailableError, match=MESSAGE) as exc:
        open_runtime(tiny_bundle, device="cuda")
    assert classify(exc.value) is Outcome.RETRY
    assert open_runtime(tiny_bundle, device="cuda", with_model=False).model is None   # tokenizer only: fine


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


def _inputs(tmp_path: Path) -> str:
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "a.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "text": f"text {i}"}) + "\n" for i in range(6)))
    return str(inp) + "/"


@pytest.mark.parametrize("command", [["run", "MANIFEST", "--device", "cuda"], ["worker", "--device", "cuda"]])
def test_the_cli_refuses_device_cuda_up_front(tmp_path: Path, tiny_bundle: str, command: list[str]) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(manifest(_inputs(tmp_path), str(tmp_path / "out"))))
    t0 = time.monotonic()
    r = _cli(*[str(path) if a == "MANIFEST" else a for a in command], timeout=60)
    assert time.monotonic() - t0 < 60
    assert r.returncode == 2 and MESSAGE in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
def test_a_manifest_asking_for_cuda_is_refused_here_within_bounded_time(tmp_path: Path, tiny_bundle: str) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(manifest(_inputs(tmp_path), str(tmp_path / "out"), options={"device": "cuda"})))
    t0 = time.monotonic()
    r = _cli("run", str(path), "--json", "--threads", "1", timeout=180)
    assert time.monotonic() - t0 < 120
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "runs on device cuda and this machine has no CUDA" in out and "options.device: cpu" in out, out
    job_id = out.split("job ", 1)[1].split()[0]
    s = json.loads(_cli("status", job_id, "--json").stdout)
    assert s["device"] == "cuda" and s["status"] not in ("failed", "running", "succeeded"), s   # left for a GPU worker
    assert not (tmp_path / "out").exists()
