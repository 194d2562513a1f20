"""The OpenAI-compatible Files and Batches API with the official `openai` client against a real
`batchinf serve`: on the embedded default (SQLite; serve runs the jobs itself) and in distributed
mode (PostgreSQL, a controller and a Celery worker, an S3 server)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.env import reset_process_state as _reset_process_state
from tests.helpers.openai_server import Server, import_tiny_bundles, serving, start
from tests.helpers.openai_server import file_lines as _lines
from tests.helpers.openai_server import set_env as _env
from tests.helpers.openai_server import upload as _upload
from tests.helpers.openai_server import wait_for as _wait
from tests.helpers.services import stop_process
from tests.helpers.services import unavailable as _unavailable
from tests.helpers.corpus import texts

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("oai-embedded"), ["--workers", "2", "--device", "cpu", "--threads", "1"],
                 import_tiny_bundles) as srv:
        yield srv


def chat_lines(n: int, model: str = "tinyllama@prod", **body: Any) -> list[dict[str, Any]]:
    return [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "messages": [{"role": "user", "content": " ".join(t.split()[:12])}], "max_tokens": 6,
                      "user": "u-1", "metadata": {"k": "v"}, "prompt_cache_key": "p", "safety_identifier": "s",
                      **body}}
            for i, t in enumerate(texts(n, seed=3))]


def embed_lines(n: int, model: str = "tiny@prod") -> list[dict[str, Any]]:
    return [{"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings",
             "body": {"model": model, "input": t, "encoding_format": "float"}} for i, t in enumerate(texts(n, seed=5))]


def _run_batch(srv: Server, lines: list[dict[str, Any]], endpoint: str, tmp: Path, name: str) -> tuple[Any, list, list]:
    client = srv.client()
    f = _upload(client, lines, tmp, name)
    assert f.object == "file" and f.purpose == "batch" and f.bytes > 0 and f.filename == f"{name}.jsonl"
    b = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h",
                              metadata={"run": name})
    assert b.status in ("validating", "in_progress") and b.metadata == {"run": name}
    b = _wait(client, b.id, {"completed", "failed", "expired", "cancelled"}, log=srv.log)
    assert b.status == "completed", b
    out, err = _lines(client, b.output_file_id), _lines(client, b.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines)       # every custom_id exactly once
    assert b.request_counts.total == len(lines) and b.request_counts.completed == len(out)
    assert b.request_counts.failed == len(err)
    assert b.completed_at and b.in_progress_at and b.finalizing_at and b.expires_at
    return b, out, err


def test_chat_and_embeddings_batches_with_the_openai_client(embedded: Server, tmp_path: Path) -> None:
    from openai.types import CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion

    lines = chat_lines(20)
    lines[3]["body"]["n"] = 2                       # cannot be honoured: its own error line
    b, out, err = _run_batch(embedded, lines, "/v1/chat/completions", tmp_path, "chat")
    assert len(out) == 19 and [e["custom_id"] for e in err] == ["chat-3"]
    assert err[0]["response"]["status_code"] == 400 and err[0]["error"]["code"] == "unsupported_n"
    for line in out:
        body = ChatCompletion.model_validate(line["response"]["body"])
        assert body.model == "tinyllama@prod" and body.system_fingerprint.startswith("fp_")
        assert body.usage.completion_tokens <= 6 and body.choices[0].message.role == "assistant"
    assert b.usage.input_tokens > 0 and b.usage.output_tokens == sum(
        x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    # the batch is a job underneath: visible in /v1/jobs and `batchinf jobs`
    job = httpx.get(f"{embedded.url}/v1/jobs/{b.job_id}",
                    headers={"Authorization": f"Bearer {embedded.tokens['acme']}"}).json()
    assert job["status"] == "succeeded" and job["name"] == b.id
    assert b.id in embedded.cli("jobs", "--json").stdout

    b, out, err = _run_batch(embedded, embed_lines(12), "/v1/embeddings", tmp_path, "emb")
    assert not err and b.error_file_id is None
    for line in out:
        body = CreateEmbeddingResponse.model_validate(line["response"]["body"])
        assert len(body.data[0].embedding) > 0 and body.model == "tiny@prod"

    client = embedded.client()
    listed = {f.id for f in client.files.list()}
    assert b.output_file_id in listed and b.input_file_id in listed
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"


def test_an_operator_mapped_model_name(embedded: Server, tmp_path: Path) -> None:
    b, out, _ = _run_batch(embedded, chat_lines(3, model="gpt-4o-mini"), "/v1/chat/completions", tmp_path, "mapped")
    assert b.model == "tinyllama@prod" and len(out) == 3


def docs_script() -> str:
    """The ten-line `openai` script of the OpenAI guide (docs/guides/openai-api.md), verbatim."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "openai-api.md").read_text()
    return page.split("<!-- openai-script -->\n```python\n", 1)[1].split("```", 1)[0]


def test_the_docs_script_runs_as_written(embedded: Server, tmp_path: Path) -> None:
    """The OpenAI guide's ten-line `openai` script, extracted verbatim, against this serve (its model
    names are mapped to the tiny bundles here, as the guide maps them to SmolLM2 and MiniLM)."""
    script = docs_script()
    assert len(script.splitlines()) <= 10 and script.startswith("import json, time, openai\n")
    (tmp_path / "docs_script.py").write_text(script)
    env = {**embedded.env, "OPENAI_BASE_URL": embedded.url + "/v1", "OPENAI_API_KEY": embedded.tokens["acme"]}
    r = subprocess.run([sys.executable, str(tmp_path / "docs_script.py")], env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    chat, emb = r.stdout.splitlines()
    assert chat.startswith("completed q1 [{") and "'role': 'assistant'" in chat
    assert re.fullmatch(r"completed q1 \[(\d+), \1\]", emb), emb


def test_validation_failure_gives_a_failed_batch_with_errors(embedded: Server, tmp_path: Path) -> None:
    client = embedded.client()
    f = _upload(client, chat_lines(3, model="no-such-model"), tmp_path, "nomodel")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "failed" and b.failed_at
    assert [(e.code, e.line) for e in b.errors.data] == [("model_not_found", 1)]
    assert "no-such-model" in b.errors.data[0].message
    lines = chat_lines(3)
    lines[1]["url"] = "/v1/embeddings"
    lines[2]["custom_id"] = "chat-0"
    f = _upload(client, lines, tmp_path, "mixed")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "failed"
    assert sorted((e.code, e.line) for e in b.errors.data) == [("duplicate_custom_id", 3), ("invalid_url", 2)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "x"}\nnot json\n')
    with open(bad, "rb") as fh, pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=fh, purpose="batch")
    assert "line 2 is not valid JSON" in info.value.message and info.value.body["line"] == 2


def test_every_error_is_openais_envelope_as_the_sdk_reads_it(embedded: Server, tmp_path: Path) -> None:
    """400, 401, 404, 409, 413 and 422 from /v1/files and /v1/batches: the SDK's exception has the
    message, type, param, code (and line) the server gave; the job API keeps its own shape."""
    client = embedded.client()

    def raised(kind: type, call: Callable[[], Any]) -> Any:
        with pytest.raises(kind) as info:
            call()
        assert isinstance(info.value.body, dict) and info.value.body["message"] in info.value.message
        return info.value

    bad = tmp_path / "third.jsonl"
    bad.write_text('{"custom_id": "a"}\n{"custom_id": "b"}\n[1, 2]\n')
    with open(bad, "rb") as fh:
        e = raised(openai.BadRequestError, lambda: client.files.create(file=fh, purpose="batch"))
    assert (e.code, e.type, e.param, e.body["line"]) == ("bad_request", "invalid_request_error", None, 3)
    assert "line 3 is a JSON list, not an object" in e.body["message"]
    e = raised(openai.BadRequestError, lambda: client.batches.create(
        input_file_id="file-00", endpoint="/v1/moderations", completion_window="24h"))
    assert (e.code, e.param) == ("bad_request", "endpoint") and "/v1/chat/completions" in e.body["message"]

    stranger = openai.OpenAI(base_url=embedded.url + "/v1", api_key="bi_wrong", max_retries=0)
    e = raised(openai.AuthenticationError, lambda: stranger.batches.list())
    assert (e.code, e.type) == ("invalid_api_key", "invalid_request_error")
    assert "batchinf token create" in e.body["message"]

    e = raised(openai.NotFoundError, lambda: client.batches.retrieve("batch_0123abcd"))
    assert (e.code, e.param, e.type) == ("not_found", "batch_id", "invalid_request_error")
    assert "batch_0123abcd" in e.body["message"]
    e = raised(openai.NotFoundError, lambda: client.files.retrieve("file-0123abcd"))
    assert (e.code, e.param) == ("not_found", "file_id")

    f = _upload(client, chat_lines(2, model="no-such-model"), tmp_path, "failing")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "failed"
    e = raised(openai.ConflictError, lambda: client.batches.cancel(b.id))
    assert e.code == "conflict" and "nothing to cancel" in e.body["message"]

    e = raised(openai.UnprocessableEntityError, lambda: client.batches.list(limit=1000))
    assert (e.code, e.param) == ("invalid_request", "limit") and "limit" in e.body["message"]
    e = raised(openai.UnprocessableEntityError, lambda: client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="soon"))
    assert (e.code, e.param) == ("invalid_request", "completion_window")
    e = raised(openai.UnprocessableEntityError, lambda: client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="999d"))
    assert (e.code, e.param) == ("invalid_manifest", "completion_window") and "366d" in e.body["message"]

    # 413: a declared length over BATCHINF_MAX_FILE_BYTES is refused before the body is read; the
    # SDK's own mapping of that real response gives its exception.
    host, port = embedded.url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {embedded.tokens['acme']}\r\n"
                     f"Content-Type: multipart/form-data; boundary=x\r\nContent-Length: {1 << 40}\r\n\r\n".encode())
        head, _, payload = sock.makefile("rb").read().partition(b"\r\n\r\n")
    status = int(head.split()[1])
    e = client._make_status_error_from_response(httpx.Response(
        status, content=payload, headers={"content-type": "application/json"},
        request=httpx.Request("POST", embedded.url + "/v1/files")))
    assert isinstance(e, openai.APIStatusError) and e.status_code == 413
    assert (e.code, e.type) == ("too_large", "invalid_request_error") and "BATCHINF_MAX_FILE_BYTES" in e.body["message"]

    with httpx.Client(base_url=embedded.url, headers={"Authorization": f"Bearer {embedded.tokens['acme']}"}) as c:
        r = c.get("/v1/jobs/job-0123456789abcdef")
    assert r.status_code == 404 and r.json()["error"] == "not_found" and "message" in r.json()


def test_cancel_mid_run_writes_batch_cancelled_lines(embedded: Server, tmp_path: Path) -> None:
    client = embedded.client()
    lines = chat_lines(120, max_tokens=40)
    f = _upload(client, lines, tmp_path, "cancelme")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = _wait(client, b.id, {"in_progress"}, log=embedded.log)
    deadline = time.monotonic() + 120
    while client.batches.retrieve(b.id).request_counts.completed == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled") and c.cancelling_at
    b = _wait(client, b.id, {"cancelled"}, log=embedded.log)
    assert b.cancelled_at
    out, err = _lines(client, b.output_file_id), _lines(client, b.error_file_id)
    assert out, "some requests finished before the cancel"
    not_run = [e for e in err if e["error"]["code"] == "batch_cancelled"]
    assert not_run and all(e["response"] is None for e in not_run)
    assert sorted(x["custom_id"] for x in out + err) == sorted(x["custom_id"] for x in lines)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(b.id)


def test_list_pagination_and_tenant_isolation(embedded: Server, tmp_path: Path) -> None:
    client = embedded.client("globex")
    f = _upload(client, chat_lines(2, model="nope"), tmp_path, "page")
    made = [client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h").id for _ in range(5)]
    first = client.batches.list(limit=2)
    assert len(first.data) == 2 and first.has_more and first.data[0].id == made[-1]
    assert [b.id for b in client.batches.list(limit=2)] == made[::-1]       # auto-pagination over `after`
    other = embedded.client("acme")
    for call in (lambda: other.batches.retrieve(made[0]), lambda: other.batches.cancel(made[0]),
                 lambda: other.files.retrieve(f.id), lambda: other.files.content(f.id),
                 lambda: other.files.delete(f.id),
                 lambda: other.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in {x.id for x in other.files.list()}
    assert made[0] not in {b.id for b in other.batches.list()}
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_files_and_batches_cli(embedded: Server, tmp_path: Path) -> None:
    path = tmp_path / "cli.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in embed_lines(4)))
    srv = embedded
    f = json.loads(srv.cli("files", "upload", str(path), "--tenant", "acme", "--json").stdout)
    assert json.loads(srv.cli("files", "show", f["id"], "--tenant", "acme", "--json").stdout)["bytes"] == f["bytes"]
    b = json.loads(srv.cli("batches", "create", "--input-file-id", f["id"], "--endpoint", "/v1/embeddings",
                           "--tenant", "acme", "--json").stdout)
    b = _wait(srv.client(), b["id"], {"completed"}, log=srv.log)
    shown = json.loads(srv.cli("batches", "show", b.id, "--tenant", "acme", "--json").stdout)
    assert shown["status"] == "completed" and shown["output_file_id"] == b.output_file_id
    out = srv.cli("files", "download", b.output_file_id, "--tenant", "acme").stdout
    assert len(out.splitlines()) == 4
    assert b.id in srv.cli("batches", "list", "--tenant", "acme").stdout
    assert srv.cli("files", "show", f["id"], "--tenant", "globex").returncode == 2


def test_submit_wait_schedule_and_backfill_run_under_embedded_serve(embedded: Server, tmp_path: Path) -> None:
    import yaml

    from tests.helpers.corpus import manifest, write_jsonl

    src = tmp_path / "in.jsonl"
    write_jsonl(src, 30, seed=1)
    m = tmp_path / "m.yaml"
    m.write_text(yaml.safe_dump(manifest(str(src), str(tmp_path / "out"), name="waited")))
    r = embedded.cli("submit", str(m), "--wait", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] == "succeeded"
    tpl = tmp_path / "nightly.yaml"
    tpl.write_text(yaml.safe_dump(manifest(str(src), str(tmp_path / "nightly" / "{ds}"), name="nightly")))
    r = embedded.cli("schedule", "add", "nightly", str(tpl), "--cron", "0 2 * * *", "--start", "2026-11-01",
                     "--no-catchup", "--json")
    assert r.returncode == 0, r.stderr
    r = embedded.cli("schedule", "backfill", "nightly", "--from", "2026-11-01", "--to", "2026-11-02", "--json")
    assert r.returncode == 0, r.stderr
    # the serve process's scheduler submits the latest due date; its controller runs all of them
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        jobs = json.loads(embedded.cli("jobs", "--schedule", "nightly", "--json").stdout)
        if len(jobs) >= 3 and all(j["status"] == "succeeded" for j in jobs):
            break
        time.sleep(1)
    else:
        raise AssertionError(f"schedule jobs: {[(j['name'], j['status']) for j in jobs]}\n{embedded.log.read_text()[-3000:]}")


def test_celery_controller_and_worker_refuse_the_embedded_ledger(embedded: Server) -> None:
    for cmd in ("controller", "worker"):
        r = embedded.cli(cmd, timeout=60)
        assert r.returncode == 2 and "batchinf serve" in r.stderr and "postgresql" in r.stderr


def test_distributed_serve_with_controller_and_celery_worker(tmp_path: Path, s3_bucket: str) -> None:
    """distributed mode: serve is only the API; a controller and a Celery worker run the batch."""
    import uuid

    from tests.helpers.services import fresh_postgres_db as _fresh_postgres_db
    try:
        import redis
        broker = f"redis://127.0.0.1:6379/{1 + uuid.uuid4().int % 15}"
        redis.Redis.from_url(broker, socket_connect_timeout=3).ping()
    except Exception as exc:  # noqa: BLE001
        _unavailable(f"Redis is not reachable: {exc}")
    mp = pytest.MonkeyPatch()
    url = _fresh_postgres_db()
    _env(mp, tmp_path, BATCHINF_DATABASE_URL=url, BATCHINF_BROKER_URL=broker,
         BATCHINF_QUEUE=f"batchinf-test-{uuid.uuid4().hex[:8]}", BATCHINF_BUNDLE_STORE=f"{s3_bucket}/bundles/",
         BATCHINF_FILES_URI=f"{s3_bucket}/files/")
    from batchinf.ledger.db import upgrade

    procs: list[subprocess.Popen] = []
    try:
        upgrade(url)
        import_tiny_bundles(tmp_path)
        srv = start(tmp_path, [], procs)
        logs = tmp_path / "logs"
        logs.mkdir()
        for name, args in (("controller", ["controller", "--tick", "0.2", "--max-in-flight", "4"]),
                           ("worker", ["worker", "--concurrency", "1", "--threads", "1", "--device", "cpu"])):
            with open(logs / f"{name}.log", "wb") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", "batchinf.cli", *args], env=dict(os.environ),
                                              stdout=out, stderr=subprocess.STDOUT))
        lines = embed_lines(10)
        lines[2]["body"]["dimensions"] = 3          # not declared by the bundle: an error line
        b, out, err = _run_batch(srv, lines, "/v1/embeddings", tmp_path, "dist")
        assert len(out) == 9 and [e["custom_id"] for e in err] == ["emb-2"]
        lines = chat_lines(6)
        b, out, err = _run_batch(srv, lines, "/v1/chat/completions", tmp_path, "dist-chat")
        assert len(out) == 6
    finally:
        for p in procs[::-1]:
            stop_process(p, timeout=20)
        mp.undo()
        _reset_process_state()
