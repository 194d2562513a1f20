"""Attack replays against a real `batchinf serve` process over PostgreSQL: each hostile request is
refused with 400/413/422 and a message, never a 500, and afterwards the server still answers
/healthz and still accepts a good manifest (nothing else broke)."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.helpers.services import free_port as _free_port
from tests.helpers.services import stop_process
from tests.helpers.api_service import Service, start_service
from tests.helpers.corpus import manifest, write_jsonl

pytestmark = pytest.mark.integration

ALIAS_BOMB = ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
              'b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n'
              'd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n'
              'name: [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n')


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from start_service(tmp_path_factory.mktemp("attacks"))


def _good(svc: Service, name: str, **extra: Any) -> dict[str, Any]:
    src = svc.root / "in" / f"{name}.jsonl"
    write_jsonl(src, 20, seed=zlib.crc32(name.encode()) % 1000)
    return manifest(str(src), str(svc.root / "out" / name), name=name, **extra)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _still_fine(svc: Service, name: str) -> None:
    """Nothing else broke: /healthz answers at once and a good manifest is still accepted."""
    t0 = time.perf_counter()
    assert httpx.get(svc.url + "/healthz", timeout=10).status_code == 200
    assert time.perf_counter() - t0 < 2
    with svc.client("acme") as c:
        r = c.post("/v1/jobs", json=_good(svc, name))
    assert r.status_code == 201, r.text


HOSTILE: list[tuple[str, str, str | bytes, int, str]] = [
    # (case, content type, body, status, in the message)
    ("alias bomb", "application/yaml", ALIAS_BOMB, 400, "anchors and aliases"),
    ("deep YAML flow", "application/yaml", "[" * 200_000, 400, "not valid YAML"),
    ("deep YAML block", "application/yaml", "".join(" " * i + "k:\n" for i in range(60)), 400, "deeper than 32"),
    ("deep JSON", "application/json", "[" * 500_000 + "]" * 500_000, 400, "nests too deeply"),
    ("moderately deep JSON", "application/json", "[" * 40 + "]" * 40, 400, "deeper than 32"),
    ("long YAML list", "application/yaml", "- 1\n" * 250_000, 400, "more than 10000 values"),
    ("huge int JSON", "application/json", '{"priority": ' + "9" * 5000 + "}", 400, "64 bits"),
    ("huge int YAML", "application/yaml", "priority: " + "9" * 5000, 400, "64 bits"),
    ("65-bit int", "application/json", '{"name": "x", "priority": 18446744073709551616}', 400, "64 bits"),
    ("not UTF-8", "application/yaml", b"name: \xff\xfe", 400, "not UTF-8"),
    ("python tag", "application/yaml", "!!python/object/apply:os.system ['true']", 400, "not valid YAML"),
]


@pytest.mark.parametrize("case, ctype, payload, status, says", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_manifests_are_refused(svc: Service, case: str, ctype: str, payload: str | bytes,
                                       status: int, says: str) -> None:
    data = payload.encode() if isinstance(payload, str) else payload
    t0 = time.perf_counter()
    with svc.client("acme") as c:
        r = c.post("/v1/jobs", content=data, headers={"Content-Type": ctype})
    took = time.perf_counter() - t0
    assert r.status_code == status, r.text[:500]
    assert r.json()["error"] == "bad_request" and says in r.json()["message"], r.text[:500]
    assert len(r.content) < 2000                       # the alias bomb once answered 80 MB
    assert took < 5, f"{case} took {took:.1f}s"
    _still_fine(svc, "after-" + case.replace(" ", "-"))


def test_a_huge_yaml_list_does_not_stall_other_tenants(svc: Service) -> None:
    """1 MiB of YAML list once held the event loop for 33 s; /healthz must keep answering."""
    body = ("- 1\n" * (1 << 18)).encode()[: 1 << 20]
    latencies: list[float] = []
    done = threading.Event()

    def attack() -> None:
        with svc.client("globex") as c:
            for _ in range(5):
                c.post("/v1/jobs", content=body, headers={"Content-Type": "application/yaml"})
        done.set()

    t = threading.Thread(target=attack)
    t.start()
    while not done.is_set():
        t0 = time.perf_counter()
        assert httpx.get(svc.url + "/healthz", timeout=10).status_code == 200
        latencies.append(time.perf_counter() - t0)
    t.join()
    assert latencies and max(latencies) < 1.0, latencies


def _raw(svc: Service, head: bytes, body_chunks: Iterator[bytes] = iter(())) -> tuple[int, bytes]:
    """Send a raw HTTP request (the body as given, stopping when the server closes) -> (status, body)."""
    u = urlsplit(svc.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head)
        try:
            for chunk in body_chunks:
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass                                        # the server answered and closed: what we want
        s.settimeout(30)
        data = b""
        while True:
            try:
                part = s.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            data += part
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def _head(svc: Service, extra: str) -> bytes:
    return (f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {svc.tokens['acme']}\r\n"
            f"Content-Type: application/yaml\r\n{extra}\r\n").encode()


def test_huge_bodies_are_refused_before_they_are_read(svc: Service) -> None:
    before = _rss_kib(svc.pid)
    # declared: refused on the header alone, nothing of the body read
    status, body = _raw(svc, _head(svc, "Content-Length: 400000000\r\n"), iter([b"x" * 65536]))
    assert status == 413 and b"over the limit of 1048576 bytes" in body, body
    for length in ("9" * 40, "lots", "-5"):              # the HTTP parser or the app refuses these
        status, body = _raw(svc, _head(svc, f"Content-Length: {length}\r\n"))
        assert status in (400, 413), (length, body)
    # chunked, no length: refused once past 1 MiB, the rest never read (400 MB offered)
    chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
    status, body = _raw(svc, _head(svc, "Transfer-Encoding: chunked\r\n"), (chunk for _ in range(6400)))
    assert status == 413 and b"too_large" in body, body
    assert _rss_kib(svc.pid) - before < 100 * 1024          # once: +1 GB
    # a body just under the limit is read and parsed (and refused for what it is, not its size)
    with svc.client("acme") as c:
        r = c.post("/v1/jobs", content=b"#" * ((1 << 20) - 10), headers={"Content-Type": "application/yaml"})
    assert r.status_code == 422 and r.json()["error"] == "invalid_manifest", r.text
    _still_fine(svc, "after-huge-bodies")


def _cursor(*key: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")


def test_hostile_query_and_path_values(svc: Service) -> None:
    with svc.client("acme") as c:
        job = c.post("/v1/jobs", json=_good(svc, "query-target")).json()["job_id"]
        for path, cursor in (("/v1/jobs", _cursor(10 ** 30, "job-1")), ("/v1/jobs", _cursor(1e308 * 10, "j")),
                             (f"/v1/jobs/{job}/errors", _cursor(1 << 64)),
                             (f"/v1/jobs/{job}/shards", _cursor(-(1 << 70), 0)),
                             (f"/v1/jobs/{job}/errors", _cursor([[[[[[1]]]]]]))):
            r = c.get(path, params={"cursor": cursor})
            assert r.status_code == 400 and "is not valid" in r.json()["message"], (path, r.text)
        for path, params in (("/v1/jobs", {"limit": "9" * 40}), ("/v1/jobs", {"limit": "-1"}),
                             ("/v1/jobs", {"status": "x" * 300}), ("/v1/jobs", {"name": "n" * 5000}),
                             ("/v1/jobs", {"name": "a\x00b"}), ("/v1/jobs", {"cursor": "c" * 5000}),
                             (f"/v1/jobs/{job}/errors", {"code": "DROP TABLE"}),
                             ("/v1/jobs/job-" + "f" * 5000, {}), ("/v1/jobs/job-0123456789abcdeg", {}),
                             (f"/v1/jobs/{job}/shards", {"status": "committed'--"})):
            r = c.get(path, params=params)
            assert r.status_code == 422 and r.json()["message"], (path, r.text[:300])
    _still_fine(svc, "after-queries")


def test_every_number_a_tenant_sets_is_bounded(svc: Service) -> None:
    cases = [({"priority": 2147483647}, "priority 2147483647 is outside the allowed range [-100, 100]"),
             ({"priority": -(1 << 62)}, "outside the allowed range"),
             ({"shards": {"max_records": 10 ** 12}}, "shards.max_records 1000000000000 is over the limit "
                                                     "shard_max_records = 100000"),
             ({"shards": {"max_tokens": 1 << 62}}, "shard_max_tokens"),
             ({"options": {"max_batch_tokens": 10 ** 12}}, "options.max_batch_tokens 1000000000000 is over "
                                                          "the limit max_batch_tokens")]
    with svc.client("acme") as c:
        for i, (extra, says) in enumerate(cases):
            r = c.post("/v1/jobs", json=_good(svc, f"bounded-{i}", **extra))
            assert r.status_code == 422, r.text
            assert says in r.json()["message"] and "batchinf tenant limit acme" in r.json()["message"], r.text
        assert c.post("/v1/jobs", json=_good(svc, "top", priority=100)).status_code == 201


def test_a_tenant_limit_is_set_with_the_cli_and_applies_to_that_tenant_only(svc: Service) -> None:
    from click.testing import CliRunner

    from batchinf.cli.limits import tenant_limit

    r = CliRunner().invoke(tenant_limit, ["globex", "max_priority", "1000", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["limits"]["max_priority"] == 1000
    with svc.client("globex") as c:
        assert c.post("/v1/jobs", json=_good(svc, "urgent-globex", priority=1000)).status_code == 201
    with svc.client("acme") as c:
        assert c.post("/v1/jobs", json=_good(svc, "urgent-acme", priority=1000)).status_code == 422
    r = CliRunner().invoke(tenant_limit, ["globex", "max_priority", "--unset"])
    assert r.exit_code == 0 and r.output.split("max_priority")[1].split()[0] == "100", r.output
    with svc.client("globex") as c:
        assert c.post("/v1/jobs", json=_good(svc, "urgent-globex-2", priority=1000)).status_code == 422
    r = CliRunner().invoke(tenant_limit, ["globex", "max_priority"])
    assert r.exit_code != 0 and "give VALUE, or --unset" in r.output
    r = CliRunner().invoke(tenant_limit, ["globex", "colour", "3"])
    assert r.exit_code != 0 and "max_priority" in r.output      # the choices are listed


def test_generate_options_are_refused_when_their_kv_cache_is_over_the_limit(svc: Service) -> None:
    from batchinf.bundles import import_bundle
    from tests.helpers.tiny_llama import make_tiny_llama

    import_bundle(make_tiny_llama(svc.root / "tiny-llama"), "tinyllama", alias="prod")
    src = svc.root / "in" / "prompts.jsonl"
    src.parent.mkdir(parents=True, exist_ok=True)      # the first test of the module to run may be this one
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "hello there"}) + "\n" for i in range(4)))

    def gen(name: str, **options: Any) -> dict[str, Any]:
        return {"name": name, "task": "generate", "bundle": "tinyllama@prod", "input": {"uri": str(src)},
                "output": {"uri": str(svc.root / "out" / name)}, "options": options}

    with svc.client("acme") as c:
        r = c.post("/v1/jobs", json=gen("kv-bomb", max_batch_tokens=10 ** 12, max_slots=64))
        assert r.status_code == 422, r.text
        message = r.json()["message"]
        # (max_batch_tokens is over its own limit first; the KV cache is checked below)
        assert "options.max_batch_tokens" in message and "max_batch_tokens" in message
        r = c.post("/v1/jobs", json=gen("kv-big", max_batch_tokens=100_000, max_slots=256))
        assert r.status_code == 201, r.text
    from click.testing import CliRunner

    from batchinf.cli.limits import tenant_limit

    assert CliRunner().invoke(tenant_limit, ["pager", "kv_cache_bytes", "1000000"]).exit_code == 0
    with svc.client("pager") as c:
        r = c.post("/v1/jobs", json=gen("kv-pager", max_batch_tokens=100_000, max_slots=256))
    assert r.status_code == 422, r.text
    assert "over the limit kv_cache_bytes = 1000000" in r.json()["message"]
    assert "set options.max_batch_tokens to at most" in r.json()["message"]
    assert "batchinf tenant limit pager kv_cache_bytes" in r.json()["message"]
    assert str(svc.root) not in r.json()["message"]                     # no server path


def test_bundles_show_no_server_paths(svc: Service) -> None:
    with svc.client("acme") as c:
        r = c.get("/v1/bundles")
    assert r.status_code == 200 and r.json()
    assert all("uri" not in b for b in r.json())
    assert str(svc.root) not in r.text and "file://" not in r.text


def _serve(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "batchinf.cli", "serve", "--port", str(port),
                             "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    stop_process(proc)
    raise AssertionError("serve did not start")


def test_metrics_are_closed_unless_the_operator_opens_them(svc: Service) -> None:
    assert httpx.get(svc.url + "/metrics").status_code == 401                    # token set
    env = {k: v for k, v in os.environ.items() if k not in ("BATCHINF_METRICS_TOKEN", "BATCHINF_METRICS_PUBLIC")}
    proc, url = _serve(env)
    try:
        r = httpx.get(url + "/metrics")
        assert r.status_code == 401 and "BATCHINF_METRICS_TOKEN" in r.json()["message"]
        assert "BATCHINF_METRICS_PUBLIC=1" in r.json()["message"]
        assert "job-" not in r.text
    finally:
        stop_process(proc)
    proc, url = _serve({**env, "BATCHINF_METRICS_PUBLIC": "1"})
    try:
        r = httpx.get(url + "/metrics")
        assert r.status_code == 200 and "batchinf_jobs" in r.text
    finally:
        stop_process(proc)


def _wait_final(svc: Service, tenant: str, job_id: str, timeout: float = 150) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    with svc.client(tenant) as c:
        while time.monotonic() < deadline:
            s = c.get(f"/v1/jobs/{job_id}").json()
            if s["status"] in ("succeeded", "failed", "cancelled", "expired"):
                return s
            time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish: {s}")


def test_error_rows_are_bounded_and_error_pages_too(svc: Service) -> None:
    """Duplicates of records with 2 MB ids become error rows that keep 1 KiB of the id and 4 KiB of the message,
    the full lengths noted; a page of errors is small; the good records still succeed."""
    from sqlalchemy import func, select

    from batchinf.ledger.db import tx
    from batchinf.ledger.tables import record_errors

    src = svc.root / "in" / "huge-ids.jsonl"
    good = write_jsonl(src, 30, seed=7, bad=False)
    big = ["A" * (2 << 20), "B" * (2 << 20), "C" * (2 << 20)]
    with open(src, "a") as f:
        for rid in big:
            f.write(json.dumps({"id": rid, "text": "the first"}) + "\n")     # succeeds
            f.write(json.dumps({"id": rid, "text": "a duplicate"}) + "\n")   # duplicate_id, the id in its message
    m = manifest(str(src), str(svc.root / "out" / "huge-ids"), name="huge-ids")
    with svc.client("acme") as c:
        job = c.post("/v1/jobs", json=m).json()["job_id"]
    svc.drive(job)
    final = _wait_final(svc, "acme", job)
    assert final["status"] == "succeeded", final
    assert final["counts"]["records_succeeded"] == len(good) + 3 and final["errors"]["records"] == 3
    with tx() as conn:
        longest = conn.execute(select(func.max(func.length(record_errors.c.record_id)),
                                      func.max(func.length(record_errors.c.message)))
                               .where(record_errors.c.job_id == job)).one()
    assert longest[0] <= 1024 and longest[1] <= 4096, longest          # once: 8 MB each
    with svc.client("acme") as c:
        r = c.get(f"/v1/jobs/{job}/errors", params={"limit": 500})
    assert r.status_code == 200 and len(r.content) < 64 * 1024, len(r.content)
    ids = [e["record_id"] for e in r.json()["items"]]
    assert len(ids) == 3 and all(i.endswith(f"… ({2 << 20} characters)") for i in ids), [i[-40:] for i in ids]


def test_a_job_over_its_error_fraction_goes_red(svc: Service) -> None:
    """A misspelled text field fails every record: with max_error_fraction the job fails with a
    message naming the fraction, the counts and the fix, instead of succeeding with only errors."""
    src = svc.root / "in" / "misspelled.jsonl"
    write_jsonl(src, 40, seed=3, bad=False)
    m = manifest(str(src), str(svc.root / "out" / "misspelled"), name="misspelled", max_error_fraction=0.5)
    m["input"]["text_field"] = "txet"
    with svc.client("acme") as c:
        job = c.post("/v1/jobs", json=m).json()["job_id"]
        for bad in (0, 1.5, -0.1, "half", True):
            m2 = dict(m, max_error_fraction=bad, name=f"frac-{bad}")
            r = c.post("/v1/jobs", json=m2)
            assert r.status_code == 422 and "max_error_fraction" in r.json()["message"], r.text
    svc.drive(job)
    final = _wait_final(svc, "acme", job)
    assert final["status"] == "failed", final
    assert final["error"].startswith("too many errors: 40 of 40 records failed (100.0%)"), final["error"]
    assert "max_error_fraction 0.5" in final["error"] and "input.text_field" in final["error"]
    assert not (svc.root / "out" / "misspelled" / "_SUCCESS").exists()
    # under the fraction a job succeeds: 6 bad lines of 26 records is under 0.5
    ok = _good(svc, "under-fraction", max_error_fraction=0.5)
    with svc.client("acme") as c:
        job = c.post("/v1/jobs", json=ok).json()["job_id"]
    svc.drive(job)
    assert _wait_final(svc, "acme", job)["status"] == "succeeded"


def test_a_job_past_the_error_row_cap_fails(svc: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchinf.config import settings

    monkeypatch.setenv("BATCHINF_MAX_ERROR_ROWS", "3")     # the driver's lifecycle runs in this process
    settings.cache_clear()
    try:
        m = _good(svc, "error-cap")                          # 20 good records and 6 bad lines
        with svc.client("acme") as c:
            job = c.post("/v1/jobs", json=m).json()["job_id"]
        svc.drive(job).join(timeout=150)
        final = _wait_final(svc, "acme", job)
    finally:
        monkeypatch.delenv("BATCHINF_MAX_ERROR_ROWS")
        settings.cache_clear()
    assert final["status"] == "failed", final
    assert final["error"].startswith("too many errors: 6 records failed, over the limit of 3 error rows per "
                                     "job (BATCHINF_MAX_ERROR_ROWS)"), final["error"]
