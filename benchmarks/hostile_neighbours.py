"""A small job's wall time alone and beside hostile jobs and requests of another tenant, and the
`batchinf serve` process's peak RSS under each.

One embedded `batchinf serve` (SQLite ledger under a temporary BATCHINF_HOME: the API, a
controller and local workers in one process tree). The victim tenant submits a 20-record embed job
through the REST API and polls it to `succeeded`: alone, then right after another tenant starts
each attack, alternating (alone, attack, alone, attack, ...). The attacks:
- an input manifest listing one large file many times (refused at pinning, before it is hashed);
- an input prefix of many small objects (a legitimate, slow pinning: it runs beside the tick);
- a gzip JSONL input that expands past BATCHINF_MAX_EXPANSION (a decompression bomb);
- a chunked body of many MiB to POST /v1/files, /v1/batches and /v1/jobs/{id}/retry.
Every attack must be refused or bounded, and every victim job must succeed.

    python benchmarks/hostile_neighbours.py           # 3 victim runs per row
    python benchmarks/hostile_neighbours.py --short   # CI: 1 run per row, smaller attacks
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.api_under_attack import _cli  # noqa: E402 -- the same CLI runner

TERMINAL = ("succeeded", "failed", "cancelled", "expired")


class Sampler:
    """The serve process's peak RSS while it runs (sampled every 20 ms): the API, the controller
    and the pinning and planning it runs beside its tick (workers are processes of their own)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _proc_rss(self.pid))
            time.sleep(0.02)

    def __enter__(self) -> "Sampler":
        self._t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._t.join()


def _proc_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _chunked(url: str, token: str, path: str, mib: int, content_type: str, head: bytes = b"") -> int:
    """POST `head`, then `mib` MiB, as a chunked body without a length; the status answered (0: none)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                   f"Content-Type: {content_type}\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
        chunk = b"100000\r\n" + b"x" * 0x100000 + b"\r\n"
        try:
            if head:
                s.sendall(b"%x\r\n%s\r\n" % (len(head), head))
            for _ in range(mib):
                s.sendall(chunk)
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        while b"\r\n" not in data:
            try:
                part = s.recv(4096)
            except (ConnectionResetError, TimeoutError):
                break
            if not part:
                break
            data += part
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0


class Bench:
    def __init__(self, short: bool) -> None:
        from tests.helpers.tiny_models import make_tiny_bert

        self.short = short
        self.tmp = tmp = Path(tempfile.mkdtemp(prefix="hostile-"))
        env = {**os.environ, "BATCHINF_HOME": str(tmp / "home")}
        env["BATCHINF_DATABASE_URL"] = f"sqlite:///{tmp / 'home' / 'ledger.db'}"
        env["BATCHINF_MAX_FILE_BYTES"] = str((4 if short else 64) << 20)     # the chunked bodies pass it
        for k in ("BATCHINF_BUNDLE_STORE", "BATCHINF_FAILPOINTS"):
            env.pop(k, None)
        self.env = env
        _cli(env, "db", "upgrade")
        _cli(env, "bundle", "import", str(make_tiny_bert(tmp / "tiny")), "--name", "tiny", "--alias", "prod")
        self.tokens = {t: json.loads(_cli(env, "token", "create", "--tenant", t, "--json"))["token"]
                       for t in ("victim", "evil")}
        for t in self.tokens:
            _cli(env, "tenant", "grant", t, "--read", str(tmp / t / "in"), "--write", str(tmp / t / "out"))
        src = tmp / "victim" / "in" / "a.jsonl"
        src.parent.mkdir(parents=True)
        src.write_text("".join(json.dumps({"id": f"r{i}", "text": f"victim record {i}"}) + "\n" for i in range(20)))
        (tmp / "evil" / "in").mkdir(parents=True)
        self.runs = 0

    def start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = subprocess.Popen([sys.executable, "-m", "batchinf.cli", "serve", "--port", str(port),
                                        "--workers", "1", "--log-level", "warning"], env=self.env,
                                       stdout=subprocess.DEVNULL, stderr=open(self.tmp / "serve.log", "wb"))
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"batchinf serve did not start: {(self.tmp / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        self.server.terminate()
        self.server.wait(timeout=60)

    def client(self, tenant: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.tokens[tenant]}"}, timeout=120)

    def submit(self, tenant: str, m: dict[str, Any]) -> str:
        with self.client(tenant) as c:
            r = c.post("/v1/jobs", json=m)
        if r.status_code != 201:
            raise SystemExit(f"{tenant}'s job was not created: {r.status_code} {r.text}")
        return r.json()["job_id"]

    def wait(self, tenant: str, job_id: str, timeout: float = 600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.client(tenant) as c:
            while True:
                s = c.get(f"/v1/jobs/{job_id}").json()
                if s["status"] in TERMINAL:
                    return s
                if time.monotonic() > deadline:
                    raise SystemExit(f"job {job_id} still {s['status']} after {timeout} s")
                time.sleep(0.1)

    def victim(self) -> float:
        """Submit the victim's small job and wait for it; its wall time from submit."""
        self.runs += 1
        t0 = time.perf_counter()
        job = self.submit("victim", {"name": f"victim-{self.runs}", "bundle": "tiny@prod",
                                     "input": {"uri": str(self.tmp / "victim" / "in") + "/"},
                                     "output": {"uri": str(self.tmp / "victim" / "out" / f"r{self.runs}") + "/"}})
        s = self.wait("victim", job)
        if s["status"] != "succeeded":
            raise SystemExit(f"the victim's job {job} ended {s['status']}: {s.get('error')}")
        return time.perf_counter() - t0

    # --- the attacks: each starts, returns a function that waits for its end and says how it ended

    def _evil_job(self, name: str, input_: dict[str, Any]) -> Callable[[], str]:
        self.runs += 1
        name = f"{name}-{self.runs}"
        job = self.submit("evil", {"name": name, "bundle": "tiny@prod", "input": input_,
                                   "output": {"uri": str(self.tmp / "evil" / "out" / name) + "/"}})
        return lambda: (lambda s: f"{s['status']}: {s.get('error') or ''}")(self.wait("evil", job))

    def same_file_many_times(self) -> Callable[[], str]:
        big = self.tmp / "evil" / "in" / "big.jsonl"
        with open(big, "wb") as f:      # (written again each time: the same bytes)
            line = json.dumps({"id": "x", "text": "y" * 1000}).encode() + b"\n"
            f.write(line * ((20 if self.short else 200) << 10))
        listing = self.tmp / "evil" / "in" / "listing.jsonl"
        listing.write_text((json.dumps({"uri": str(big)}) + "\n") * 60)
        return self._evil_job("same-file", {"manifest": str(listing)})

    def many_objects(self) -> Callable[[], str]:
        wide = self.tmp / "evil" / "in" / "wide"
        wide.mkdir(exist_ok=True)
        for i in range(200 if self.short else 600):
            (wide / f"p{i:05d}.jsonl").write_text(json.dumps({"id": f"w{i}", "text": f"wide {i}"}) + "\n")
        return self._evil_job("wide", {"uri": str(wide) + "/"})

    def gzip_bomb(self) -> Callable[[], str]:
        bomb = self.tmp / "evil" / "in" / "bomb" / "a.jsonl.gz"
        bomb.parent.mkdir(exist_ok=True)
        if bomb.exists():
            return self._evil_job("gzip-bomb", {"uri": str(bomb.parent) + "/"})
        with gzip.open(bomb, "wb", compresslevel=9) as f:
            f.write(json.dumps({"id": "b0", "text": "real"}).encode() + b"\n")
            block = b" " * (1 << 20)
            for _ in range(300 if self.short else 2000):
                f.write(block)
        return self._evil_job("gzip-bomb", {"uri": str(bomb.parent) + "/"})

    def chunked_bodies(self) -> Callable[[], str]:
        mib = 16 if self.short else 200        # over every route's limit (uploads: BATCHINF_MAX_FILE_BYTES + 1 MiB)
        statuses: dict[str, int] = {}

        def post() -> None:
            upload = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b\r\n'
                      b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n')
            for path, ctype, head in (("/v1/files", "multipart/form-data; boundary=b", upload),
                                      ("/v1/batches", "application/json", b'{"input_file_id": "'),
                                      ("/v1/jobs/job-0000000000000000/retry", "application/json", b'{"output": "')):
                statuses[path] = _chunked(self.url, self.tokens["evil"], path, mib, ctype, head)
        t = threading.Thread(target=post, daemon=True)
        t.start()
        return lambda: (t.join(), "answered " + ", ".join(f"{p} {c}" for p, c in statuses.items()))[1]


def run(short: bool) -> dict[str, Any]:
    b = Bench(short)
    b.start()
    try:
        baseline = _proc_rss(b.server.pid)
        b.victim()                                                  # warm: the workers have loaded the bundle
        rows: dict[str, Any] = {}
        alone: list[float] = []
        for name, attack in (("same file listed 60 times", b.same_file_many_times),
                             ("many objects", b.many_objects), ("gzip bomb", b.gzip_bomb),
                             ("chunked bodies", b.chunked_bodies)):
            beside = []
            with Sampler(b.server.pid) as sampler:
                for _ in range(1 if short else 3):
                    alone.append(b.victim())
                    ended = attack()
                    beside.append(b.victim())
                    outcome = ended()
            rows[name] = {"victim_s": round(statistics.median(beside), 2), "attack_ended": outcome,
                          "serve_peak_rss_mib": round(sampler.peak / 2**20, 1),
                          "serve_rss_growth_mib": round((sampler.peak - baseline) / 2**20, 1)}
    finally:
        b.stop()
    median_alone = statistics.median(alone)
    for r in rows.values():
        r["ratio"] = round(r["victim_s"] / median_alone, 2)
    return {"victim_alone_s": round(median_alone, 2), "serve_baseline_rss_mib": round(baseline / 2**20, 1),
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="1 victim run per row, smaller attacks; correctness only")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    report = run(a.short)
    if a.json:
        print(json.dumps(report))
        return
    print(f"victim's 20-record job alone: {report['victim_alone_s']} s (median); serve RSS at start "
          f"{report['serve_baseline_rss_mib']} MiB")
    print(f"{'beside':<28} {'victim s':>9} {'ratio':>6} {'serve peak MiB':>15} {'growth MiB':>11}  attack ended")
    for name, r in report["rows"].items():
        print(f"{name:<28} {r['victim_s']:>9} {r['ratio']:>5}x {r['serve_peak_rss_mib']:>15} "
              f"{r['serve_rss_growth_mib']:>11}  {r['attack_ended'][:110]}")


if __name__ == "__main__":
    main()
