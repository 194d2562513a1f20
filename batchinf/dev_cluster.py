"""`batchinf dev cluster` / `dev down`: distributed mode on one laptop, in one command.

On loopback it starts what a cluster needs and prints the environment that points batchinf at
it: a PostgreSQL ledger (a database it creates on an existing server, `database_url`, or a
temporary cluster of its own made with `initdb`), Redis (an existing one, `broker_url`, or a
`redis-server` of its own), an S3 server (moto) with one versioned bucket and credentials, the
migrations, a controller and N Celery workers. Everything it started, and where, is kept in
`<BATCHINF_HOME>/dev-cluster/cluster.json`, which `down` reads to stop it all and remove what it
created (the database or cluster, the bucket's server, the logs).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from batchinf.config import foreign_environment, settings
from batchinf.errors import ConfigError
from batchinf.dispatch import pid_alive
from batchinf.ledger.db import create_database, drop_database

BUCKET = "batchinf"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "batchinf-dev", "AWS_SECRET_ACCESS_KEY": "batchinf-dev",
               "AWS_DEFAULT_REGION": "us-east-1"}
START_SECONDS = 60.0


@dataclass
class DevCluster:
    root: str                                   # <home>/dev-cluster: logs, the state file, a temporary ledger
    env: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)      # process group leaders, by name
    pg_data: str | None = None                  # a temporary PostgreSQL cluster's data directory
    pg_user: str | None = None                  # who runs it (root cannot: `postgres`)
    pg_bin: str | None = None                   # where initdb and pg_ctl are
    server_url: str | None = None               # an existing server: the database created on it is dropped
    database: str | None = None

    @property
    def state_file(self) -> Path:
        return Path(self.root) / "cluster.json"

    def save(self) -> None:
        self.state_file.write_text(json.dumps(asdict(self), indent=2))

    def alive(self) -> dict[str, bool]:
        return {name: pid_alive(pid) for name, pid in self.pids.items()}


def root_dir() -> Path:
    return settings().home / "dev-cluster"


def load() -> DevCluster | None:
    path = root_dir() / "cluster.json"
    return DevCluster(**json.loads(path.read_text())) if path.exists() else None


def up(workers: int = 2, *, database_url: str | None = None, broker_url: str | None = None) -> DevCluster:
    """Start the cluster (or return the one already up); its `env` is what to export."""
    running = load()
    if running is not None and any(running.alive().values()):
        return running
    root = root_dir()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    c = DevCluster(str(root))
    try:
        _ledger(c, database_url)
        c.env["BATCHINF_BROKER_URL"] = broker_url or _redis(c)
        c.env["BATCHINF_QUEUE"] = f"batchinf-dev-{secrets.token_hex(4)}"   # a shared Redis: a queue of its own
        _s3(c)
        c.save()
        _run(c, [sys.executable, "-m", "batchinf.cli", "db", "upgrade"], "migrations")
        _spawn(c, "controller", [sys.executable, "-m", "batchinf.cli", "controller"])
        for k in range(1, workers + 1):
            _spawn(c, f"worker{k}", [sys.executable, "-m", "batchinf.cli", "worker", "--concurrency", "1",
                                     "--hostname", f"dev{k}@%h"])
        c.save()
    except BaseException:
        down(c)
        raise
    return c


def down(c: DevCluster | None = None) -> dict[str, Any]:
    """Stop what `up` started and remove what it created; what was stopped."""
    c = c or load()
    if c is None:
        return {"stopped": [], "message": "no dev cluster is up"}
    stopped = _stop_all(dict(reversed(list(c.pids.items()))))
    if c.pg_data:
        _pg(c, ["pg_ctl", "-D", c.pg_data, "-m", "fast", "stop"], check=False)
        shutil.rmtree(c.pg_data, ignore_errors=True)
        stopped.append("postgres")
    elif c.server_url and c.database:
        drop_database(c.server_url, c.database)
    shutil.rmtree(c.root, ignore_errors=True)
    return {"stopped": stopped}


def exports(env: dict[str, str]) -> str:
    """`export K=V` lines for a POSIX shell."""
    import shlex

    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


# --- the parts ---------------------------------------------------------------------------------


def _ledger(c: DevCluster, server_url: str | None) -> None:
    if server_url:
        c.server_url, c.database = server_url, f"batchinf_dev_{secrets.token_hex(4)}"
        create_database(server_url, c.database)
        c.env["BATCHINF_DATABASE_URL"] = _with_database(server_url, c.database)
        return
    binaries = _pg_binaries()
    if binaries is None:
        raise ConfigError("no initdb found to make a temporary PostgreSQL cluster: install PostgreSQL, or pass "
                          "--database-url postgresql://USER@HOST:PORT/ of a server to create the ledger on")
    c.pg_bin = binaries
    c.pg_user = "postgres" if os.geteuid() == 0 else None          # PostgreSQL refuses to run as root
    # as root the data directory must be one `postgres` can reach: a directory of its own in the temp dir
    data = Path(tempfile.mkdtemp(prefix="batchinf-dev-pg-")) if c.pg_user else Path(c.root) / "pg"
    data.mkdir(exist_ok=True)
    if c.pg_user:
        shutil.chown(data, c.pg_user)
    c.pg_data = str(data)
    port = _free_port()
    _pg(c, ["initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"])
    _pg(c, ["pg_ctl", "-D", str(data), "-l", str(data / "postgres.log"), "-w", "-t", "60", "-o",
            f"-p {port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off", "start"])
    server = f"postgresql://postgres@127.0.0.1:{port}/"
    c.database = "batchinf"
    create_database(server, c.database)
    c.env["BATCHINF_DATABASE_URL"] = _with_database(server, c.database)


def _redis(c: DevCluster) -> str:
    if shutil.which("redis-server") is None:
        raise ConfigError("no redis-server found: install Redis, or pass --broker-url redis://HOST:PORT/DB "
                          "(a shared Redis is fine: the cluster gets a queue of its own)")
    port = _free_port()
    _spawn(c, "redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no"])
    _wait_port(port, "redis-server", c)
    return f"redis://127.0.0.1:{port}/0"


def _s3(c: DevCluster) -> None:
    try:
        import moto  # noqa: F401 -- only to say what to install
    except ImportError:
        raise ConfigError("the dev cluster's S3 server is moto's: pip install 'batchinf[dev]'") from None
    port = _free_port()
    _spawn(c, "s3", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)])
    _wait_port(port, "the S3 server (moto)", c)
    endpoint = f"http://127.0.0.1:{port}"
    c.env.update(CREDENTIALS, BATCHINF_S3_ENDPOINT_URL=endpoint, BATCHINF_BUNDLE_STORE=f"s3://{BUCKET}/bundles/",
                 BATCHINF_FILES_URI=f"s3://{BUCKET}/files/")
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                      region_name=CREDENTIALS["AWS_DEFAULT_REGION"])
    s3.create_bucket(Bucket=BUCKET)
    s3.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})


def _child_env(c: DevCluster) -> dict[str, str]:
    return {**foreign_environment(), "BATCHINF_HOME": str(settings().home), **c.env}


def _spawn(c: DevCluster, name: str, argv: list[str]) -> None:
    log = open(Path(c.root) / f"{name}.log", "ab")
    p = subprocess.Popen(argv, env=_child_env(c), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         start_new_session=True)
    c.pids[name] = p.pid


def _run(c: DevCluster, argv: list[str], what: str) -> None:
    r = subprocess.run(argv, env=_child_env(c), capture_output=True, text=True, timeout=300, check=False)
    if r.returncode != 0:
        raise ConfigError(f"dev cluster: {what} failed: {(r.stderr or r.stdout).strip()[-1500:]}")


def _pg(c: DevCluster, argv: list[str], check: bool = True) -> None:
    argv = [str(Path(c.pg_bin or "") / argv[0]), *argv[1:]]
    full = ["runuser", "-u", c.pg_user, "--", *argv] if c.pg_user else argv
    r = subprocess.run(full, capture_output=True, text=True, timeout=120, check=False)
    if check and r.returncode != 0:
        raise ConfigError(f"dev cluster: {' '.join(argv[:1])} failed: {(r.stderr or r.stdout).strip()[-1500:]}")


def _pg_binaries() -> str | None:
    if (found := shutil.which("initdb")) is not None:
        return str(Path(found).parent)
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return str(versions[-1].parent) if versions else None


def _with_database(server_url: str, database: str) -> str:
    parts = urlsplit(server_url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, ""))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, what: str, c: DevCluster) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise ConfigError(f"dev cluster: {what} did not start on port {port} (see {c.root})")


def _signal(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _stop_all(pids: dict[str, int], grace: float = 10.0) -> list[str]:
    """SIGTERM every process group at once, SIGKILL what is left after `grace` seconds; the names
    of those that were running."""
    running = [name for name, pid in pids.items() if pid_alive(pid) and _signal(pid, signal.SIGTERM)]
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_alive(pids[n]) for n in running):
        for n in running:
            try:
                os.waitpid(pids[n], os.WNOHANG)         # our own children (a failed `up`) are reaped
            except ChildProcessError:
                pass
        time.sleep(0.1)
    for n in running:
        if pid_alive(pids[n]):
            _signal(pids[n], signal.SIGKILL)
    return running
