"""Private service instances for tests that restart them (chaos): a PostgreSQL cluster and a Redis
server on free loopback ports, owned by one test, so restarting them disturbs nobody else."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


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
        _wait_port(self.port)
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
