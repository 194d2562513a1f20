"""Fixtures for the integration tests: the ledger on both backends, and the distributed-mode
`cluster` (tests/helpers/cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cluster import Cluster, start_cluster


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request: pytest.FixtureRequest) -> str:
    """The same behaviour on both ledger backends: yields the database url, schema at head
    (built by Alembic, never create_all)."""
    return request.getfixturevalue({"sqlite": "sqlite_ledger", "postgresql": "postgres_ledger"}[request.param])


@pytest.fixture
def cluster(tmp_path: Path, bi_home: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A PostgreSQL ledger, a Redis broker and an S3 bucket for a controller and Celery workers
    started as real processes by the test (`cluster.controller()`, `cluster.worker(name)`)."""
    yield from start_cluster(tmp_path, s3_bucket, monkeypatch)
