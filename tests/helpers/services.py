"""Real services for the tests that need them, and the one rule for when one is missing.

`unavailable(reason)` skips the test, or fails it when BATCHINF_REQUIRE_SERVICES=1 (CI): nothing is
skipped silently there. Below it: a moto S3 server in a subprocess, fresh PostgreSQL databases on the
shared server, Redis/RabbitMQ reachability, and private PostgreSQL/Redis instances on free loopback
ports for tests that restart them (chaos), so restarting them disturbs nobody else.

Nothing here is imported by the unit suite's fixtures at collection time: psycopg, boto3 and redis
are imported inside the functions that use them.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

POSTGRES_ADMIN_URL = os.environ.get("BATCHINF_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("BATCHINF_TEST_REDIS", "redis://127.0.0.1:6379")
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


def unavailable(reason: str) -> None:
    """A service or model the test needs is missing: skip, or fail under BATCHINF_REQUIRE_SERVICES=1."""
    if os.environ.get("BATCHINF_REQUIRE_SERVICES") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def launch_serve(log: Path, env: dict[str, str], *args: str) -> tuple[subprocess.Popen, str]:
    """`batchinf serve` on a free port (output to `log`), once /healthz answers: (process, url).
    A server that exits or stays silent for 60 s is `unavailable`, with its log's tail."""
    import httpx

    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "batchinf.cli", "serve", "--port", str(port),
                                 "--log-level", "warning", *args], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            unavailable(f"batchinf serve did not start: {log.read_text()[-3000:]}")
        time.sleep(0.2)


# --- S3 (moto) -----------------------------------------------------------------------------------


@contextmanager
def moto_server() -> Iterator[str]:
    """A real moto S3 server in a subprocess; exports its endpoint and test credentials in os.environ
    while it runs. Yields its url."""
    with moto_process() as (url, _):
        yield url


@contextmanager
def moto_process() -> Iterator[tuple[str, subprocess.Popen]]:
    """`moto_server`, yielding its url and its process too: a test of its own server may pause it
    (SIGSTOP, SIGCONT) or kill it without disturbing the session's."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()  # a file, not a pipe: the server logs every request
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    except OSError as exc:
        unavailable(f"cannot start moto server: {exc}")
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            break
        except urllib.error.HTTPError:
            break  # it answered
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                log.seek(0)
                unavailable(f"moto server did not answer on {url}: {log.read()[-2000:].decode(errors='replace')}")
            time.sleep(0.1)
    env = {
        "BATCHINF_S3_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    from batchinf import config

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    config.settings.cache_clear()       # settings are read once per process
    try:
        yield url, proc
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        config.settings.cache_clear()
        stop_process(proc)
        log.close()


def make_bucket(versioned: bool) -> str:
    """Create a fresh, uniquely named bucket on the test S3 server; returns ``s3://<bucket>``."""
    import boto3

    bucket = f"test-{uuid.uuid4().hex[:24]}"
    s3 = boto3.client("s3", endpoint_url=os.environ["BATCHINF_S3_ENDPOINT_URL"])
    s3.create_bucket(Bucket=bucket)
    if versioned:
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    return f"s3://{bucket}"


# --- PostgreSQL, Redis, RabbitMQ on their usual ports ---------------------------------------------


def fresh_postgres_db() -> str:
    """A new, empty database on the shared PostgreSQL server; returns its url."""
    try:
        import psycopg
    except ImportError as exc:
        unavailable(f"psycopg is not installed: {exc}")
    name = f"bi_test_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        unavailable(f"PostgreSQL is not reachable at {POSTGRES_ADMIN_URL}: {exc}")
    return POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + "/" + name


def fresh_redis_db() -> str:
    """A flushed Redis database (1-15) on the shared server; returns its url. Databases are handed
    out in turn by a counter in database 0, so concurrent test processes (pytest-xdist workers,
    other sessions) get different ones: Celery's control exchange is per database, and a worker
    of one test must never answer another's."""
    try:
        import redis

        n = redis.Redis.from_url(f"{REDIS_URL}/0", socket_connect_timeout=3).incr("batchinf-tests:next-db")
        url = f"{REDIS_URL}/{1 + n % 15}"
        redis.Redis.from_url(url, socket_connect_timeout=3).flushdb()
    except Exception as exc:  # noqa: BLE001
        unavailable(f"Redis is not reachable at {REDIS_URL}: {exc}")
    return url


def require_rabbitmq() -> str:
    """RabbitMQ's url, once something answers on 127.0.0.1:5672."""
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=3).close()
    except OSError as exc:
        unavailable(f"RabbitMQ is not reachable on 127.0.0.1:5672: {exc}")
    return RABBITMQ_URL


# --- private instances, for tests that restart them ----------------------------------------------


class PrivatePostgres:
    """initdb + pg_ctl on a temp data directory (run as the `postgres` user when we are root)."""

    def __init__(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        found = shutil.which("pg_ctl") or (bins[-1] if bins else None)
        if not found:
            raise RuntimeError("pg_ctl not found (install PostgreSQL server binaries)")
        self.bin = Path(found).parent
        # its own directory under /tmp: pytest's tmp_path is private to root, postgres can't enter it
        self.data, self.port = Path(tempfile.mkdtemp(prefix="batchinf-pg-")) / "pgdata", free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr or r.stdout}")

    def start(self) -> PrivatePostgres:
        if not self.data.exists():
            self.data.mkdir(parents=True)
            if os.geteuid() == 0:
                shutil.chown(self.data.parent, "postgres")
                shutil.chown(self.data, "postgres")
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.data / "server.log"), "-w", "-o",
                  f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data}", "start")
        return self

    def restart(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.data / "server.log"), "-m", "fast", "-w",
                  "restart")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        except RuntimeError:
            pass
        shutil.rmtree(self.data.parent, ignore_errors=True)


class PrivateRedis:
    """redis-server without persistence: a restart loses every queued message."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if not exe:
            raise RuntimeError("redis-server not found")
        self.exe, self.port = exe, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> PrivateRedis:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self, down_seconds: float = 1.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()
