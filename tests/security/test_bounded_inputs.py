"""Bounds on what a tenant hands a real embedded `batchinf serve` (API, controller loop and a local
worker over SQLite, inputs on a moto S3 server): a chunked body over the limit on any route that
reads one gets 413 with its memory bounded; a number of any YAML/JSON spelling past the bound is a
400; a gzip-bomb S3 Inventory fails its job at once, naming the bounded reader, instead of
swelling the controller and being retried. Each attack prints the peak RSS growth of the serve
process and its children."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.helpers.env import reset_process_state, subprocess_env, use_home
from tests.helpers.services import launch_serve, make_bucket, moto_server, stop_process

pytestmark = pytest.mark.integration

FILE_LIMIT = 3 << 20                 # BATCHINF_MAX_FILE_BYTES of this server: uploads are bounded at it + 1 MiB
RSS_GOAL_KIB = 200 * 1024            # the peak RSS growth each attack may cost


@dataclass
class Served:
    url: str
    token: str
    pid: int
    bucket: str
    root: Path


def _cli(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=subprocess_env(), capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from batchinf.bundles import import_bundle
    from tests.helpers.tiny_models import make_tiny_bert

    root = tmp_path_factory.mktemp("bounded")
    mp = pytest.MonkeyPatch()
    with moto_server():
        mp.delenv("BATCHINF_TENANT", raising=False)
        use_home(mp, root / "home", BATCHINF_MAX_FILE_BYTES=str(FILE_LIMIT))
        import_bundle(make_tiny_bert(root / "tiny"), "tiny", alias="prod")
        bucket = make_bucket(versioned=True)
        token = json.loads(_cli("token", "create", "--tenant", "acme", "--json"))["token"]
        _cli("tenant", "grant", "acme", "--read", f"{bucket}/", "--write", f"{bucket}/out/")
        proc, url = launch_serve(root / "serve.log", subprocess_env(), "--workers", "1", "--device", "cpu")
        try:
            yield Served(url, token, proc.pid, bucket, root)
        finally:
            stop_process(proc)
            mp.undo()
            reset_process_state()


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _status(pid: int, key: str) -> int:
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(key + ":"))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[1])


class PeakRss:
    """Peak RSS growth (KiB) of a process tree across a block: each process's high-water mark is
    reset (clear_refs 5) at the start, and its peak minus its start summed at the end."""

    def __init__(self, pid: int, what: str) -> None:
        self.pid, self.what, self.start = pid, what, {}

    def __enter__(self) -> PeakRss:
        for p in _tree(self.pid):
            try:
                Path(f"/proc/{p}/clear_refs").write_text("5")
            except OSError:
                continue
            self.start[p] = _status(p, "VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.growth = sum(max(0, _status(p, "VmHWM") - rss) for p, rss in self.start.items())
        print(f"\n{self.what}: peak RSS growth of serve and its workers {self.growth / 1024:.1f} MiB")


def _chunked(url: str, head: str, chunks: int, chunk_bytes: int, first: bytes = b"") -> tuple[int, bytes, int]:
    """POST a chunked body: `first`, then `chunks` x `chunk_bytes` (stopping when the server
    closes) -> (status, body, bytes sent)."""
    u = urlsplit(url)
    piece = f"{chunk_bytes:x}\r\n".encode() + b"7" * chunk_bytes + b"\r\n"
    sent = 0
    with socket.create_connection((u.hostname, u.port), timeout=60) as s:
        s.sendall(head.encode() + b"Transfer-Encoding: chunked\r\n\r\n")
        if first:
            s.sendall(f"{len(first):x}\r\n".encode() + first + b"\r\n")
        try:
            for _ in range(chunks):
                s.sendall(piece)
                sent += chunk_bytes
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass                                    # the server answered and closed: what we want
        data = b""
        while True:
            try:
                part = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not part:
                break
            data += part
    assert data, "no answer"
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1], sent


JOB = "job-" + "0123456789abcdef"
FORM = (b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n")   # then the file's bytes, for ever
ROUTES = [  # (route, content type, the limit's bytes, the fix the message names)
    ("/v1/jobs", "application/yaml", 1 << 20, "a job manifest is a few hundred bytes"),
    ("/v1/batches", "application/json", 1 << 20, "a job manifest is a few hundred bytes"),
    (f"/v1/jobs/{JOB}/retry", "application/json", 1 << 20, "a job manifest is a few hundred bytes"),
    ("/v1/files", "multipart/form-data; boundary=xyz", FILE_LIMIT + (1 << 20), "BATCHINF_MAX_FILE_BYTES"),
]


@pytest.mark.parametrize("route, ctype, limit, fix", ROUTES, ids=[r[0].split("/")[-1] for r in ROUTES])
def test_a_chunked_body_over_the_limit_is_cut_off_on_every_route(served: Served, route: str, ctype: str,
                                                                  limit: int, fix: str) -> None:
    head = (f"POST {route} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {served.token}\r\n"
            f"Content-Type: {ctype}\r\n")
    offered = 160 << 20
    with PeakRss(served.pid, f"POST {route}, {offered >> 20} MiB chunked") as rss:
        status, body, sent = _chunked(served.url, head, offered // 40_000, 40_000,
                                      FORM if route == "/v1/files" else b"")
    assert status == 413, body[:300]
    msg = json.loads(body)
    if route.startswith(("/v1/files", "/v1/batches")):      # OpenAI's envelope on its routes
        msg = {"error": msg["error"]["code"], "message": msg["error"]["message"]}
    assert msg["error"] == "too_large" and f"over the limit of {limit} bytes" in msg["message"] and fix in msg["message"]
    assert sent < offered                           # the server stopped reading: the rest was never taken
    assert rss.growth < RSS_GOAL_KIB, rss.growth
    assert httpx.get(served.url + "/healthz", timeout=10).status_code == 200


def test_a_chunked_body_within_the_limit_is_still_read(served: Served) -> None:
    """The bound cuts only what is over it: a chunked batch body is parsed (and refused for what it says)."""
    def body() -> Iterator[bytes]:
        yield b'{"input_file_id": "file-00", '
        yield b'"endpoint": "/v1/chat/completions", "completion_window": "24h"}'

    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.token}"}) as c:
        r = c.post("/v1/batches", content=body(), headers={"Content-Type": "application/json"})
    assert r.status_code in (400, 404, 422) and r.json()["error"]["code"] != "too_large", r.text


NUMBERS = {   # a spelling of a number past the bound -> the manifest text
    "decimal": "9" * 321, "negative": "-" + "4" * 222, "hex": "0x" + "7f" * 900, "octal": "0o" + "3" * 555,
    "binary": "0b" + "1" * 700, "underscored": "1" + "_234" * 80, "base 60": "12" + ":34" * 4_000,
    "base 60 float": "1" + ":05" * 500 + ".5", "float": "3." + "1" * 400, "signed hex": "+0x" + "a" * 300,
}


@pytest.mark.parametrize("spelling", NUMBERS, ids=list(NUMBERS))
def test_every_spelling_of_a_long_number_is_a_400(served: Served, spelling: str) -> None:
    doc = f"name: n\nbundle: tiny@prod\ninput: {{uri: {served.bucket}/in/}}\noutput: {{uri: {served.bucket}/out/x/}}\n" \
          f"priority: {NUMBERS[spelling]}\n"
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.token}"}, timeout=30) as c:
        r = c.post("/v1/jobs", content=doc.encode(), headers={"Content-Type": "application/yaml"})
        assert r.status_code == 400 and "characters long, over the limit of 100" in r.json()["message"], r.text
        if not spelling.startswith(("base", "octal", "hex", "binary", "underscored", "signed")):   # JSON has these
            raw = '{"name": "n", "priority": ' + NUMBERS[spelling].lstrip("+") + "}"
            r = c.post("/v1/jobs", content=raw.encode(), headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and "characters long" in r.json()["message"], r.text


def test_huge_manifest_numbers_and_bad_names_are_refused(served: Served) -> None:
    base = {"name": "n", "bundle": "tiny@prod", "input": {"uri": f"{served.bucket}/in/"},
            "output": {"uri": f"{served.bucket}/out/y/"}}
    cases = [({"shards": {"target_workers": 3 << 61}}, f"shards.target_workers {3 << 61} is over the limit of 10000"),
             ({"options": {"dimensions": 5 << 60}}, f"options.dimensions {5 << 60} is over the limit of 65536"),
             ({"name": "\x00" * 999}, "name holds the control character"),
             ({"name": "q" * 1000}, "name is 1000 characters long, over the limit of 200")]
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.token}"}, timeout=30) as c:
        for extra, says in cases:
            r = c.post("/v1/jobs", json={**base, **extra})
            assert r.status_code == 422 and says in r.json()["message"], r.text


# --- a decompression bomb as an S3 Inventory --------------------------------------------------


def _put(uri: str, data: bytes) -> None:
    from batchinf.store import get_store

    get_store(uri).put_bytes(uri, data)


def _gzip(piece: bytes, total: int) -> bytes:
    """`piece` repeated to `total` bytes, gzipped a chunk at a time (the bomb is never whole here)."""
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = piece * max(1, (1 << 20) // len(piece))
    parts, done = [], 0
    while done < total:
        parts.append(co.compress(chunk))
        done += len(chunk)
    return b"".join([*parts, co.flush()])


def _bomb_inventory(served: Served, name: str, piece: bytes, total: int) -> str:
    bucket = served.bucket.removeprefix("s3://")
    blob = _gzip(piece, total)
    key = f"inv/{name}/data/a.csv.gz"
    _put(f"{served.bucket}/{key}", blob)
    manifest = {"sourceBucket": bucket, "destinationBucket": f"arn:aws:s3:::{bucket}", "version": "2016-11-30",
                "fileFormat": "CSV", "fileSchema": "Bucket, Key, VersionId, IsLatest, IsDeleteMarker",
                "files": [{"key": key, "size": len(blob)}]}
    _put(f"{served.bucket}/inv/{name}/manifest.json", json.dumps(manifest).encode())
    print(f"\n{name}: {len(blob)} bytes of gzip, {total >> 20} MiB decompressed")
    return f"{served.bucket}/inv/{name}/manifest.json"


BOMBS = {  # kind -> (what it repeats, decompressed MiB, what the failed job says)
    "zeros": (b"\x00", 600, "longer than 65536 bytes"),
    "one long line": (b"b,k" * 1000, 450, "longer than 65536 bytes"),
    "repeated rows": (None, 380, "lists more than 100000 objects (limit input_objects)"),
    "long rows": (None, 300, "decompresses past 134217728 bytes"),
}


@pytest.mark.parametrize("kind", BOMBS, ids=list(BOMBS))
def test_a_gzip_bomb_inventory_fails_its_job_at_once(served: Served, kind: str) -> None:
    bucket = served.bucket.removeprefix("s3://")
    piece, mib, says = BOMBS[kind]
    if piece is None:        # rows of a real inventory: short ones hit the rows' bound, long ones the bytes'
        key, version = ("data/x.jsonl", "") if kind == "repeated rows" else ("data/" + "k" * 900, "v" * 1600)
        piece = f'"{bucket}","{key}","{version}","true","false"\n'.encode()
    uri = _bomb_inventory(served, kind.replace(" ", "-"), piece, mib << 20)
    doc = {"name": f"bomb-{kind}", "bundle": "tiny@prod", "input": {"manifest": uri, "format": "jsonl"},
           "output": {"uri": f"{served.bucket}/out/{kind.replace(' ', '-')}/"}}
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {served.token}"}, timeout=30) as c:
        with PeakRss(served.pid, f"gzip bomb inventory, {kind}") as rss:
            r = c.post("/v1/jobs", json=doc)
            assert r.status_code == 201, r.text
            job_id = r.json()["job_id"]
            deadline = time.monotonic() + 120      # a transient error would be retried for far longer
            while (job := c.get(f"/v1/jobs/{job_id}").json())["status"] not in ("failed", "succeeded", "cancelled"):
                assert time.monotonic() < deadline, job
                time.sleep(0.5)
    assert job["status"] == "failed", job
    assert "S3 Inventory file" in job["error"] and "a.csv.gz" in job["error"] and says in job["error"], job["error"]
    assert rss.growth < RSS_GOAL_KIB, rss.growth
