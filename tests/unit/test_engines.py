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


def test_a_pooling_job_on_vllm_is_checked_against_what_its_pooler_does(bi_home: Path, tmp_path: Path) -> None:
    """vLLM's pooling runner pools by CLS, mean or last token: a bundle that pools otherwise, or has
    Dense layers after pooling, is refused on vllm when the job is created, naming why; one it can
    run as native does is accepted."""
    from tests.helpers.tiny_st import make_st_bert

    for name, modes, kw in (("maxpool", ["max"], {}), ("twomodes", ["cls", "mean"], {}),
                            ("dense", ["mean"], {"dense_out": 16})):
        import_bundle(make_st_bert(tmp_path / name, modes, **kw), "tinyllama", alias="prod")
        why = "Dense layers" if name == "dense" else "vLLM's pooler pools by cls, mean, lasttoken only"
        with pytest.raises(ManifestError, match=f"engine vllm cannot run bundle tinyllama@prod for task embed: .*{why}"):
            _job(tmp_path, f"embed-{name}", "vllm", task="embed")
    import_bundle(make_st_bert(tmp_path / "meanpool", ["mean"]), "tinyllama", alias="prod")
    assert jobs.get(_job(tmp_path, "embed-mean", "vllm", task="embed")).engine == "vllm"
    with pytest.raises(ManifestError, match="engine openai-http runs task generate, not embed"):
        _job(tmp_path, "embed-http", "openai-http", task="embed")


def test_a_worker_refuses_an_engine_whose_package_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.cli import main

    monkeypatch.setitem(engines.PACKAGES, "vllm", ("batchinf_no_such_package", "pip install it"))
    with pytest.raises(engines.EngineUnavailable, match="batchinf_no_such_package"):
        engines.require(("native", "vllm"))
    out = CliRunner().invoke(main, ["worker", "--engine", "vllm"])
    assert out.exit_code != 0 and "engine vllm needs the batchinf_no_such_package package" in out.output
    # by default: native, and onnxruntime where it is installed
    assert engines.require(())[0] == "native" and set(engines.require(())) <= {"native", "onnxruntime"}


# --- the openai-http engine's checks and mapping (no server needed) ---------------------------------

def test_an_endpoint_holds_no_credentials_and_names_only_its_own_key_variable() -> None:
    from batchinf.engines.openai_http import endpoint_spec
    from batchinf.errors import BundleError

    spec = endpoint_spec("http://127.0.0.1:8080/v1/", "m")
    assert spec["base_url"] == "http://127.0.0.1:8080/v1" and spec["api_key_env"] == "BATCHINF_OPENAI_HTTP_API_KEY"
    for bad, why in [("http://user:secret@host/v1", "no credentials"), ("ftp://host/v1", "http:// or https://"),
                     ("http://host/v1?key=1", "no credentials"), ("file:///etc/passwd", "http:// or https://")]:
        with pytest.raises(BundleError, match=why):
            endpoint_spec(bad, "m")
    with pytest.raises(BundleError, match="only a BATCHINF_OPENAI_HTTP_"):
        endpoint_spec("http://h/v1", "m", api_key_env="AWS_SECRET_ACCESS_KEY")
    with pytest.raises(BundleError, match="out of range"):
        endpoint_spec("http://h/v1", "m", concurrency=100000)


def test_every_sampling_field_reaches_the_request_body() -> None:
    from batchinf.checks import canonical_response_format
    from batchinf.engines.openai_http import _retry_after, completion_body
    from batchinf.runtime.generation.sampling import SamplingParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = canonical_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    p = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=42, stop=("\n",), logprobs=2,
                       response_format=fmt)
    body = completion_body("m", [1, 2, 3], p)
    assert {k: body[k] for k in ("model", "prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                                 "logprobs")} == {"model": "m", "prompt": [1, 2, 3], "max_tokens": 7, "temperature": 0.5,
                                                  "top_k": 3, "top_p": 0.9, "seed": 42, "stop": ["\n"], "logprobs": 2}
    assert body["response_format"]["type"] == "json_schema" and body["json_schema"] == schema
    assert "top_k" not in completion_body("m", [1], SamplingParams(max_tokens=1))
    assert _retry_after("3") == 3.0 and _retry_after(None) is None and _retry_after("soon") is None
    assert _retry_after("Thu, 01 Jan 1970 00:00:00 GMT") == 0.0


def test_an_engine_loads_only_the_pinned_files(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The digests are checked before any engine sees the files: a bundle changed after import is
    refused whatever the engine; an engine this process lacks is refused by name."""
    from batchinf.bundles import local_dir, open_runtime
    from batchinf.errors import BundleError

    monkeypatch.setitem(engines.PACKAGES, "vllm", ("batchinf_no_such_package", "pip install it"))
    with pytest.raises(engines.EngineUnavailable, match="engine vllm needs"):
        open_runtime(tiny_llama, engine="vllm")
    weights = local_dir(tiny_llama) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(BundleError, match="model.safetensors"):
        open_runtime(tiny_llama, engine="vllm")
