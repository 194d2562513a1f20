"""The openai-http engine end to end against a real llama.cpp `llama-server` on loopback serving the
SmolLM2 GGUF (built from the llama-cpp-python source package): a job's answers equal the server
called directly with the same token ids and params; a server killed and restarted mid-job, and one
answering 429 with Retry-After, still give every record exactly once; retries that run out give
error rows naming the answer; an endpoint serving another model is refused naming the fixture."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from batchinf.bundles import import_bundle
from batchinf.controller import drive
from batchinf.engines.openai_http import endpoint_spec
from batchinf.ledger import status
from batchinf.ledger.jobs import get as job_row
from batchinf.manifest import parse_manifest
from batchinf.parts import read_table
from batchinf.store import get_store, join
from batchinf.submit import submit
from batchinf.verify import MANIFEST, verify_output
from tests.helpers.env import OPERATOR, reset_process_state, use_home
from tests.helpers.llama_server import MODEL, LlamaServer, throttling_proxy

pytestmark = pytest.mark.integration

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors.",
             "What is 2+2?", "Say hello in Spanish.", "Who wrote Hamlet?", "What colour is the sky?",
             "Count to five.", "What is water made of?", "Name a fruit.", "What is the opposite of hot?",
             "How many legs has a cat?"]


class World:
    def __init__(self, home: Path, server: LlamaServer, model_dir: Path, tmp: Path) -> None:
        self.home, self.server, self.model_dir, self.tmp = home, server, model_dir, tmp
        self.native = import_bundle(model_dir, "smollm2", alias="native").digest
        self.http = self.import_http("http", server.base_url, max_tries=30)

    def import_http(self, alias: str, base_url: str, **knobs: Any) -> str:
        spec = endpoint_spec(base_url, MODEL, concurrency=4, backoff_seconds=0.2, backoff_cap_seconds=2.0, **knobs)
        return import_bundle(self.model_dir, "smollm2", alias=alias, endpoint=spec).digest

    def job(self, name: str, alias: str, n: int = len(QUESTIONS), **options: Any) -> str:
        inp = self.tmp / f"{name}.jsonl"
        chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]
        inp.write_text("".join(json.dumps({"id": f"q{i}", "messages": m}) + "\n" for i, m in enumerate(chats)))
        raw = {"name": name, "task": "generate", "bundle": f"smollm2@{alias}",
               "input": {"uri": str(inp), "messages_field": "messages"}, "output": {"uri": str(self.tmp / "out" / name)},
               "shards": {"max_records": 6}, "options": {"max_tokens": 12, **options}}
        job_id, _ = submit(parse_manifest(raw), OPERATOR)
        return job_id


@pytest.fixture(scope="module")
def world(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from batchinf.runtime.gguf import convert_gguf

    tmp = tmp_path_factory.mktemp("openai-http")
    with pytest.MonkeyPatch.context() as mp:
        home = use_home(mp, tmp / "home")
        server = LlamaServer(smollm2_gguf, tmp / "llama-server.log", slots=2, threads=1)
        server.start()
        try:
            yield World(home, server, convert_gguf(smollm2_gguf, tmp / "model"), tmp)
        finally:
            server.stop()
            reset_process_state()


def results(job_id: str) -> tuple[dict[str, dict], list[dict]]:
    """The published job's result rows by record id, and its error rows (coverage verified)."""
    out = job_row(job_id).output_uri
    assert verify_output(out)["ok"]
    m = json.loads(get_store(out).get_bytes(join(out, MANIFEST)))
    rows: dict[str, list[dict]] = {"results": [], "errors": []}
    for p in m["parts"]:
        if p["kind"] in rows:
            rows[p["kind"]] += read_table(join(out, p["key"])).to_pylist()
    by_id = {r["record_id"]: r for r in rows["results"]}
    assert len(by_id) == len(rows["results"])                # exactly once
    return by_id, rows["errors"]


def staged(job_id: str) -> dict[str, dict]:
    """What the engine sent for each record: its prompt ids (the bundle's chat template and
    tokenizer) and its params (the job's options, the record's own seed), as planning stages them."""
    from batchinf.bundles import open_runtime
    from batchinf.tasks.generate import record_params

    job = job_row(job_id)
    runtime = open_runtime(job.bundle_digest, with_model=False)
    rows = {}
    for line in Path(job.input_uri.removeprefix("file://")).read_text().splitlines():
        r = json.loads(line)
        rows[r["id"]] = {"input_ids": runtime.encode_chat(r["messages"]),
                         **record_params(job.manifest.options, r["id"], None)}
    return rows


def direct(server: LlamaServer, row: dict) -> str:
    body = {"model": MODEL, "prompt": row["input_ids"], "max_tokens": row["max_tokens"],
            "temperature": row["temperature"], "top_p": row["top_p"], "seed": row["seed"]}
    if row["top_k"]:
        body["top_k"] = row["top_k"]
    return httpx.post(server.base_url + "/completions", json=body, timeout=120).json()["choices"][0]["text"]


def run(job_id: str) -> str:
    final = drive(job_id, workers=1, threads=1)
    assert final == "succeeded", job_row(job_id).error
    return final


@pytest.mark.slow
def test_answers_equal_the_server_called_directly(world: World) -> None:
    job_id = world.job("greedy", "http")
    assert job_row(job_id).engine == "openai-http"            # the bundle's declared engine
    run(job_id)
    got, errors = results(job_id)
    assert not errors and len(got) == len(QUESTIONS)
    rows = staged(job_id)
    for rid, r in got.items():
        assert r["text"] == direct(world.server, rows[rid]), rid
        assert r["input_tokens"] == len(rows[rid]["input_ids"]) and r["output_tokens"] >= 1
    # the same prompts on batchinf's own runtime (the GGUF dequantised to float32): llama.cpp computes
    # with activations quantised to 8 bits, so near-ties may differ; most greedy answers agree
    native_id = world.job("greedy-native", "native")
    assert job_row(native_id).engine == "native"
    run(native_id)
    native, _ = results(native_id)
    same = sum(native[rid]["text"] == r["text"] for rid, r in got.items())
    print(f"openai-http (llama.cpp Q4_1) vs native (float32): {same}/{len(got)} greedy answers equal")
    assert same >= len(got) // 2


@pytest.mark.slow
def test_seeded_sampling_is_sent_per_record(world: World) -> None:
    job_id = world.job("sampled", "http", n=6, temperature=0.9, top_k=40, top_p=0.95, seed=11)
    run(job_id)
    got, _ = results(job_id)
    rows = staged(job_id)
    assert len({r["seed"] for r in rows.values()}) == 6        # each record its own seed
    for rid, r in got.items():
        assert r["text"] == direct(world.server, rows[rid]), rid


@pytest.mark.slow
def test_a_server_killed_and_restarted_mid_job_gives_every_record_once(world: World) -> None:
    job_id = world.job("killed", "http", n=24)
    final: list[str] = []
    driver = threading.Thread(target=lambda: final.append(drive(job_id, workers=1, threads=1)))
    driver.start()
    deadline = time.monotonic() + 120
    while status.status(job_id)["counts"]["records_done"] < 3:
        assert time.monotonic() < deadline and driver.is_alive(), "the job never got going"
        time.sleep(0.1)
    world.server.kill()
    time.sleep(2)
    world.server.start()
    driver.join(300)
    assert final == ["succeeded"], job_row(job_id).error
    got, errors = results(job_id)
    assert not errors and sorted(got) == sorted(f"q{i}" for i in range(24))


def _pinned(digest: str) -> list[dict]:
    from batchinf.bundles import local_dir

    return json.loads((local_dir(digest) / "bundle.json").read_text())["engine"]["fixtures"]


@pytest.mark.slow
def test_429_with_retry_after_is_waited_out_and_each_record_sent_once(world: World,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINF_OPENAI_HTTP_API_KEY", "sekrit-key")      # the worker's environment
    with throttling_proxy(world.server.port, retry_after=1.0) as proxy:
        digest = world.import_http("throttled", proxy["base_url"])
        assert digest != world.http                           # another endpoint: another bundle
        job_id = world.job("throttled", "throttled", n=6)
        proxy["left"], before = 8, proxy["forwarded"]         # the next 8 requests answer 429
        run(job_id)
        got, errors = results(job_id)
        assert not errors and len(got) == 6 and proxy["throttled"] == 8
        # what reached the server: the fixtures replayed at load, then each record once
        assert proxy["forwarded"] - before == len(_pinned(digest)) + 6
        assert proxy["authorization"] == "Bearer sekrit-key"
        from batchinf.bundles import local_dir

        assert "sekrit" not in (local_dir(digest) / "bundle.json").read_text()


@pytest.mark.slow
def test_retries_that_run_out_are_error_rows_naming_the_answer(world: World) -> None:
    with throttling_proxy(world.server.port, retry_after=0.1) as proxy:
        world.import_http("exhausted", proxy["base_url"], max_tries=2)
        job_id = world.job("exhausted", "exhausted", n=4)
        # the records ask for 12 tokens, the fixture replay for 8: only the records are refused
        proxy["left"], proxy["match"] = 10 ** 6, lambda body: body.get("max_tokens") == 12
        run(job_id)
        got, errors = results(job_id)
        assert not got and sorted(e["record_id"] for e in errors) == ["q0", "q1", "q2", "q3"]
        assert all(e["error"] == "inference_error" for e in errors)
        assert all("no answer after 2 tries" in e["message"] and "HTTP 429" in e["message"] for e in errors)
        assert proxy["throttled"] == 4 * 2                    # each record tried twice, no more


@pytest.mark.slow
def test_an_endpoint_now_serving_another_model_fails_the_job_naming_the_fixture(world: World) -> None:
    from tests.helpers.llama_quantize import requantised_smollm2

    other = requantised_smollm2("Q2_K")
    world.server.stop()
    world.server.gguf, original = other, world.server.gguf
    world.server.start()
    try:
        job_id = world.job("drifted", "http", n=2)
        assert drive(job_id, workers=1, threads=1) == "failed"
        error = job_row(job_id).error
        assert "openai-http fixture" in error and "drifted" in error and "now answers" in error, error
    finally:
        world.server.stop()
        world.server.gguf = original
        world.server.start()
