"""Fixtures for the integration tests: the ledger on both backends. (The distributed-mode `cluster`
is in tests/conftest.py, for the security tests too.)"""

from __future__ import annotations

import pytest


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request: pytest.FixtureRequest) -> str:
    """The same behaviour on both ledger backends: yields the database url, schema at head
    (built by Alembic, never create_all)."""
    return request.getfixturevalue({"sqlite": "sqlite_ledger", "postgresql": "postgres_ledger"}[request.param])
