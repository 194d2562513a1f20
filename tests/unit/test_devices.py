"""Routing by device: a job's device (options.device unless auto, else the bundle's, else any) is
resolved at job creation and kept; a worker claims only shards of jobs on its device or any (each
claim path), on a broker reads the queues of its engines and device, and an embedded pool of one
job refuses a device its job does not run on instead of waiting for a worker that never comes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinf import engines
from batchinf.bundles import import_bundle
from batchinf.dispatch import WorkerPool
from batchinf.errors import DeviceUnavailableError, ManifestError
from batchinf.ledger import jobs, leases, shards, status
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from tests.helpers.stages import plan_job
from tests.helpers.tiny_llama import make_tiny_llama


@pytest.fixture
def tiny_llama(bi_home: Path, tmp_path: Path) -> str:
    return import_bundle(make_tiny_llama(tmp_path / "tiny-llama"), "tinyllama", alias="prod").digest


def _job(tmp_path: Path, name: str, device: str | None, engine: str | None = None) -> str:
    inp = tmp_path / f"{name}.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"the world {i}"}) + "\n" for i in range(3)))
    raw = {"name": name, "task": "generate", "bundle": "tinyllama@prod", "input": {"uri": str(inp)},
           "output": {"uri": str(tmp_path / "out" / name)}, "options": {"max_tokens": 3}}
    if device is not None:
        raw["options"]["device"] = device
    if engine is not None:
        raw["engine"] = engine
    return submit(parse_manifest(raw), OPERATOR)[0]


def _queued(job_id: str) -> list[str]:
    plan_job(job_id)
    shards.dispatch_ready(job_id)
    return [s.id for s in shards.of_job(job_id)]


def test_queue_names_by_engine_and_device() -> None:
    # jobs on any device keep the queues they had before devices (native: the base queue)
    assert engines.queue_of("bi", "native") == "bi" and engines.queue_of("bi", "vllm") == "bi-vllm"
    assert engines.queue_of("bi", "native", "cuda") == "bi-cuda"
    assert engines.queue_of("bi", "vllm", "cuda") == "bi-vllm-cuda"
    assert engines.queue_of("bi", "openai-http", "any") == "bi-openai-http"
    assert engines.worker_queues("bi", ("native", "vllm"), "cuda") == ["bi", "bi-cuda", "bi-vllm", "bi-vllm-cuda"]
    assert engines.worker_queues("bi", ("native",), "cpu") == ["bi", "bi-cpu"]
    assert engines.worker_devices("cpu") == ("any", "cpu")


def test_the_device_is_resolved_at_job_creation(tiny_llama: str, tmp_path: Path) -> None:
    assert jobs.get(_job(tmp_path, "auto", None)).device == "any"
    assert jobs.get(_job(tmp_path, "cuda", "cuda")).device == "cuda"
    assert jobs.get(_job(tmp_path, "cpu", "cpu")).device == "cpu"
    # a bundle may declare the device it needs; options.device still wins
    assert engines.job_device("auto", {"device": "cuda"}, "native", "b") == "cuda"
    assert engines.job_device("cpu", {"device": "cuda"}, "vllm", "b") == "cpu"
    with pytest.raises(ManifestError, match="openai-http runs on the server bundle b names"):
        engines.job_device("cuda", {}, "openai-http", "b")
    with pytest.raises(ManifestError, match="device 'tpu' is unknown"):
        engines.job_device("auto", {"device": "tpu"}, "native", "b")


def test_a_cuda_job_never_lands_on_a_cpu_worker(tiny_llama: str, tmp_path: Path) -> None:
    cuda_job, any_job = _job(tmp_path, "on-cuda", "cuda"), _job(tmp_path, "on-any", None)
    cuda_shards, any_shards = set(_queued(cuda_job)), set(_queued(any_job))
    cpu = engines.worker_devices("cpu")
    taken = []
    while (lease := leases.claim_next(None, "w:1", 30, devices=cpu)) is not None:
        taken.append(lease.shard_id)
    assert set(taken) == any_shards                     # a cpu worker runs the job on any device, not the cuda one
    assert leases.claim_next([cuda_job], "w:1", 30, devices=cpu) is None
    assert all(leases.claim_shard(s, "w:1", 30, devices=cpu) is None for s in cuda_shards)
    assert leases.claim_next([cuda_job], "w:1", 30) is None             # the default: a cpu worker
    view = status.status(cuda_job)
    assert view["device"] == "cuda" and view["shards"]["running"] == 0
    assert "on device cuda" in view["waiting"] and "--device cuda" in view["waiting"]
    assert status.status(any_job)["device"] == "any"
    # a cuda worker takes it; a cpu worker cannot run its twin
    (shard,) = cuda_shards
    lease = leases.claim_next(None, "w:2", 30, devices=engines.worker_devices("cuda"))
    assert lease is not None and lease.shard_id == shard and lease.job.device == "cuda"
    assert leases.claim_speculative(shard, "w:3", devices=cpu) is None
    assert leases.claim_speculative(shard, "w:3", devices=engines.worker_devices("cuda")) is not None
    assert status.status(cuda_job)["waiting"] is None


def test_a_cpu_job_is_left_to_cpu_workers(tiny_llama: str, tmp_path: Path) -> None:
    (shard,) = _queued(_job(tmp_path, "on-cpu", "cpu"))
    assert leases.claim_shard(shard, "w:1", 30, devices=engines.worker_devices("cuda")) is None
    assert leases.claim_shard(shard, "w:1", 30, devices=engines.worker_devices("cpu")) is not None


def test_an_embedded_pool_refuses_a_device_its_job_does_not_run_on(tiny_llama: str, tmp_path: Path) -> None:
    cuda_job = jobs.get(_job(tmp_path, "on-cuda", "cuda"))
    with pytest.raises(DeviceUnavailableError, match=rf"job {cuda_job.id} runs on device cuda.*--device cuda"):
        WorkerPool(cuda_job, device="cpu")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError, match="this machine has no CUDA.*options.device: cpu"):
            WorkerPool(cuda_job, device="auto")
    cpu_job = jobs.get(_job(tmp_path, "on-cpu", "cpu"))
    assert WorkerPool(cpu_job, device="auto").device == "cpu"       # auto: the job's device
    with pytest.raises(DeviceUnavailableError, match="runs on device cpu"):
        WorkerPool(cpu_job, device="cuda")
    assert WorkerPool(jobs.get(_job(tmp_path, "on-any", None)), device="auto").device == "auto"


def test_the_fleet_that_sizes_a_job_has_its_engine(tiny_llama: str, tmp_path: Path) -> None:
    """A pool counts as a job's workers only when it has the job's engine: a vllm job's shards are
    not cut for native workers that will never run them."""
    native_job, vllm_job = jobs.get(_job(tmp_path, "n", None)), jobs.get(_job(tmp_path, "v", None, engine="vllm"))
    pool = WorkerPool(workers=3, engines=("native",), device="cpu")
    assert pool.workers(native_job.route) == 3 and pool.workers(None) == 3
    assert pool.workers(vllm_job.route) is None
    assert pool.workers(engines.Route("native", "cuda")) is None


def test_each_route_has_its_own_in_flight_slots(tiny_llama: str, tmp_path: Path) -> None:
    """Shards queued for workers that are absent (a cuda job, every worker on cpu) hold no slot of
    the fleet that is there: the controller shares each route's fleet among that route's jobs."""
    from batchinf.controller import Controller
    from batchinf.dispatch import Dispatcher
    from batchinf.ledger.states import ShardStatus

    class OneCpuWorker(Dispatcher):
        resends_lost = True

        def workers(self, route: engines.Route | None = None) -> int | None:
            return 1 if route is None or route.device in ("any", "cpu") else None

    cuda_jobs = [_job(tmp_path, f"cuda{i}", "cuda") for i in range(4)]
    any_job = _job(tmp_path, "any", None)
    for j in [*cuda_jobs, any_job]:
        plan_job(j)
    Controller(OneCpuWorker(), max_in_flight=16).tick()
    queued = {j: sum(s.status == ShardStatus.QUEUED for s in shards.of_job(j)) for j in [*cuda_jobs, any_job]}
    assert queued[any_job] == 1, queued     # before: the cuda jobs' shards took every slot of the cpu fleet
