"""Fixtures of the unit suite, which runs with no service."""

from __future__ import annotations

import pytest


@pytest.fixture
def ledger(sqlite_ledger: str) -> str:
    """The unit suite's ledger: embedded SQLite (the PostgreSQL run of the same contract is in
    tests/integration/test_ledger_contract_postgres.py)."""
    return sqlite_ledger
