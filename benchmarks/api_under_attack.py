"""The REST API under hostile load: p50 latency of `GET /v1/jobs/{id}` for one tenant while another
client posts hostile manifests in a loop, against the same measurement with the API idle.

One `batchinf serve` process (uvicorn, one worker) over a fresh ledger (SQLite under a temporary
BATCHINF_HOME, or --database-url). The victim polls one job's status sequentially; the attacker, a
separate process with its own token, cycles without pause through: a YAML alias bomb, 1 MiB of YAML
list, deeply nested JSON and YAML, integers of thousands of digits and of 65 bits, a priority of
2**31-1, a body declaring 400 MB, and an 8 MiB chunked body without a length. Every attack must be
answered 400/413/422 (the run fails on any 5xx or a connection the server dropped without answer).

    python benchmarks/api_under_attack.py            # 400 requests idle, 400 under attack
    python benchmarks/api_under_attack.py --short    # CI: 40 + 40, correctness only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
ALIAS_BOMB = ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
              + "".join(f"{n}: &{n} [{','.join(['*' + p] * 9)}]\n" for p, n in zip("abcd", "bcde"))
              + "name: [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n")
ATTACKS: list[tuple[str, str, bytes]] = [
    ("alias bomb", "application/yaml", ALIAS_BOMB.encode()),
    ("1 MiB YAML list", "application/yaml", (b"- 1\n" * (1 << 18))[: (1 << 20) - 1]),
    ("deep JSON", "application/json", b"[" * 400_000 + b"]" * 400_000),
    ("deep YAML", "application/yaml", "".join(" " * i + "k:\n" for i in range(200)).encode()),
    ("4300+ digit int", "application/json", b'{"name": "x", "priority": ' + b"9" * 5000 + b"}"),
    ("65-bit int", "application/json", b'{"name": "x", "priority": 18446744073709551616}'),
    ("priority 2**31-1", "application/json", json.dumps({
        "name": "x", "bundle": "tiny@prod", "input": {"uri": "/nonexistent/in.jsonl"},
        "output": {"uri": "/nonexistent/out/"}, "priority": 2147483647}).encode()),
]


def _cli(env: dict[str, str], *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode:
        raise SystemExit(f"batchinf {' '.join(args)} failed: {r.stderr[-2000:]}")
    return r.stdout


def _raw_post(host: str, port: int, token: str, head_extra: str, chunks: int) -> int:
    """A raw POST (Content-Length declared but not sent, or a chunked body) -> the status answered."""
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall((f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                   f"Content-Type: application/yaml\r\n{head_extra}\r\n").encode())
        chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
        try:
            for _ in range(chunks):
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        while b"\r\n" not in data:
            try:
                part = s.recv(4096)
            except ConnectionResetError:
                break
            if not part:
                break
            data += part
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0


def attacker(url: str, token: str, stop: Any, out: Any) -> None:
    """Post hostile manifests in a loop until `stop` is set; report {attack: {status: count}}."""
    counts: dict[str, dict[int, int]] = {}
    host, port = url.removeprefix("http://").split(":")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as c:
        while not stop.is_set():
            for name, ctype, body in ATTACKS:
                status = c.post("/v1/jobs", content=body, headers={"Content-Type": ctype}).status_code
                counts.setdefault(name, {}).setdefault(status, 0)
                counts[name][status] += 1
            for name, extra, chunks in (("400 MB declared", "Content-Length: 400000000\r\n", 1),
                                        ("8 MiB chunked", "Transfer-Encoding: chunked\r\n", 128)):
                status = _raw_post(host, int(port), token, extra, chunks)
                counts.setdefault(name, {}).setdefault(status, 0)
                counts[name][status] += 1
    out.put(counts)


def _latencies(url: str, token: str, job_id: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as c:
        for _ in range(5):                                       # warm the connection and caches
            c.get(f"/v1/jobs/{job_id}")
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.get(f"/v1/jobs/{job_id}")
            out.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise SystemExit(f"GET /v1/jobs/{job_id} answered {r.status_code}: {r.text[:300]}")
    return out


def _summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_ms": round(statistics.median(xs) * 1000, 2),
            "p95_ms": round(xs[int(len(xs) * 0.95) - 1] * 1000, 2), "max_ms": round(xs[-1] * 1000, 2)}


def run(n: int, database_url: str | None) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.helpers.tiny_models import make_tiny_bert

    tmp = Path(tempfile.mkdtemp(prefix="api-attack-"))
    env = {**os.environ, "BATCHINF_HOME": str(tmp / "home"), "BATCHINF_METRICS_TOKEN": "bench"}
    env["BATCHINF_DATABASE_URL"] = database_url or f"sqlite:///{tmp / 'home' / 'ledger.db'}"
    env.pop("BATCHINF_BUNDLE_STORE", None)
    _cli(env, "db", "upgrade")
    _cli(env, "bundle", "import", str(make_tiny_bert(tmp / "tiny")), "--name", "tiny", "--alias", "prod")
    tokens = {t: json.loads(_cli(env, "token", "create", "--tenant", t, "--json"))["token"] for t in ("victim", "evil")}
    _cli(env, "tenant", "grant", "victim", "--read", str(tmp / "in.jsonl"), "--write", str(tmp / "out"))
    (tmp / "in.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "text": f"record {i}"}) + "\n" for i in range(10)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "batchinf.cli", "serve", "--port", str(port),
                               "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("batchinf serve did not start")
            time.sleep(0.2)
        manifest = {"name": "victim", "bundle": "tiny@prod", "input": {"uri": str(tmp / "in.jsonl")},
                    "output": {"uri": str(tmp / "out") + "/"}}
        r = httpx.post(url + "/v1/jobs", json=manifest, headers={"Authorization": f"Bearer {tokens['victim']}"})
        if r.status_code != 201:
            raise SystemExit(f"submit failed: {r.status_code} {r.text}")
        job_id = r.json()["job_id"]
        idle = _latencies(url, tokens["victim"], job_id, n)
        ctx = mp.get_context("fork")
        queue, stop = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=attacker, args=(url, tokens["evil"], stop, queue))
        proc.start()
        time.sleep(1.0)                                          # the attack is under way
        attacked = _latencies(url, tokens["victim"], job_id, n)
        stop.set()                                               # it finishes its round, then reports
        statuses = queue.get(timeout=300)
        proc.join(timeout=60)
        health = httpx.get(url + "/healthz", timeout=10).status_code
    finally:
        server.terminate()
        server.wait(timeout=30)
    bad = {k: v for k, v in statuses.items() if any(s >= 500 or s == 0 or s < 400 for s in v)}
    report = {"requests": n, "idle": _summary(idle), "under_attack": _summary(attacked),
              "p50_ratio": round(statistics.median(attacked) / statistics.median(idle), 2),
              "attack_statuses": {k: {str(s): c for s, c in v.items()} for k, v in statuses.items()},
              "healthz_after": health, "ledger": "postgresql" if database_url else "sqlite"}
    if bad or health != 200:
        raise SystemExit(f"an attack was not refused with 4xx: {bad}; healthz {health}; {json.dumps(report)}")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="40 requests each; correctness only")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--database-url", help="a PostgreSQL ledger instead of SQLite (must exist and be empty)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    report = run(40 if a.short else a.requests, a.database_url)
    if a.json:
        print(json.dumps(report))
        return
    print(f"GET /v1/jobs/{{id}} over {report['requests']} requests ({report['ledger']} ledger)")
    for k in ("idle", "under_attack"):
        s = report[k]
        print(f"  {k:<13} p50 {s['p50_ms']:7.2f} ms   p95 {s['p95_ms']:7.2f} ms   max {s['max_ms']:7.2f} ms")
    print(f"  p50 under attack / idle: {report['p50_ratio']}x")
    for name, st in report["attack_statuses"].items():
        print(f"  attack {name:<18} answered {st}")


if __name__ == "__main__":
    main()
