"""The engine seam: a job's engine is resolved and checked at job creation, and a worker claims
only shards of jobs on the engines it has (each claim path: next, named, speculative), so a job
needing an engine no worker has waits queued, and its status says what for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchinf import engines
from batchinf.bundles import import_bundle
from batchinf.errors import ManifestError
from batchinf.ledger import jobs, leases, shards, status
from batchinf.manifest import parse_manifest
from batchinf.submit import submit
from tests.helpers.env import OPERATOR
from tests.helpers.stages import plan_job
from tests.helpers.tiny_llama import make_tiny_llama


@pytest.fixture
def tiny_llama(bi_home: Path, tmp_path: Path) -> str:
    return import_bundle(make_tiny_llama(tmp_path / "tiny-llama"), "tinyllama", alias="prod").digest


def _job(tmp_path: Path, name: str, engine: str | None, task: str = "generate") -> str:
    inp = tmp_path / f"{name}.jsonl"
    field = "prompt" if task == "generate" else "text"
    inp.write_text("".join(json.dumps({"id": f"r{i}", field: f"the world {i}"}) + "\n" for i in range(3)))
    raw = {"name": name, "task": task, "bundle": "tinyllama@prod", "input": {"uri": str(inp)},
           "output": {"uri": str(tmp_path / "out" / name)}}
    if task == "generate":
        raw["options"] = {"max_tokens": 3}
    if engine is not None:
        raw["engine"] = engine
    job_id, _ = submit(parse_manifest(raw), OPERATOR)
    return job_id


def _queued(job_id: str) -> list[str]:
    plan_job(job_id)
    shards.dispatch_ready(job_id)
    return [s.id for s in shards.of_job(job_id)]


def test_a_job_on_an_engine_no_worker_has_waits_queued_and_status_says_why(tiny_llama: str, tmp_path: Path) -> None:
    vllm_job = _job(tmp_path, "on-vllm", "vllm")
    assert jobs.get(vllm_job).engine == "vllm"
    (shard,) = _queued(vllm_job)
    # a native worker finds nothing, by any claim path
    assert leases.claim_next([vllm_job], "w:1", 30) is None
    assert leases.claim_next(None, "w:1", 30) is None
    assert leases.claim_shard(shard, "w:1", 30) is None
    view = status.status(vllm_job)
    assert view["engine"] == "vllm" and view["shards"]["running"] == 0
    assert "engine vllm" in view["waiting"] and "--engine vllm" in view["waiting"]
    # a worker with the engine takes it; a native twin cannot join it
    lease = leases.claim_next(None, "w:2", 30, engines=("native", "vllm"))
    assert lease is not None and lease.shard_id == shard and lease.job.engine == "vllm"
    assert leases.claim_speculative(shard, "w:3") is None
    assert leases.claim_speculative(shard, "w:3", engines=("vllm",)) is not None
    assert status.status(vllm_job)["waiting"] is None


def test_a_shared_worker_takes_only_its_engines_jobs(tiny_llama: str, tmp_path: Path) -> None:
    native_job, vllm_job = _job(tmp_path, "native", None), _job(tmp_path, "vllm", "vllm")
    native_shards, vllm_shards = set(_queued(native_job)), set(_queued(vllm_job))
    taken = []
    while (lease := leases.claim_next(None, "w:1", 30)) is not None:
        taken.append(lease.shard_id)
    assert set(taken) == native_shards
    assert all(leases.claim_shard(s, "w:1", 30) is None for s in vllm_shards)
    assert status.status(native_job)["waiting"] is None


def test_the_engine_is_checked_at_job_creation(tiny_llama: str, tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="names its server"):
        _job(tmp_path, "http", "openai-http")          # the bundle names no endpoint
    with pytest.raises(ManifestError, match="not supported; use one of native, vllm, openai-http"):
        _job(tmp_path, "other", "sglang")
    assert jobs.get(_job(tmp_path, "default", None)).engine == "native"


def test_an_embed_job_on_vllm_is_refused(bi_home: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    import_bundle(tiny_model_dir, "tinyllama", alias="prod")      # an embedding model
    with pytest.raises(ManifestError, match="engine vllm runs task generate, not embed"):
        _job(tmp_path, "embed", "vllm", task="embed")


def test_a_worker_refuses_an_engine_whose_package_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.cli import main

    monkeypatch.setitem(engines.PACKAGES, "vllm", ("batchinf_no_such_package", "pip install it"))
    with pytest.raises(engines.EngineUnavailable, match="batchinf_no_such_package"):
        engines.require(("native", "vllm"))
    out = CliRunner().invoke(main, ["worker", "--engine", "vllm"])
    assert out.exit_code != 0 and "engine vllm needs the batchinf_no_such_package package" in out.output
    assert engines.require(()) == ("native",)
