"""Fixtures for the integration tests: the distributed-mode `cluster` (tests/helpers/cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cluster import Cluster, start_cluster


@pytest.fixture
def cluster(tmp_path: Path, bi_home: Path, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A PostgreSQL ledger, a Redis broker and an S3 bucket for a controller and Celery workers
    started as real processes by the test (`cluster.controller()`, `cluster.worker(name)`)."""
    yield from start_cluster(tmp_path, s3_bucket, monkeypatch)
