"""The ledger contract (tests/helpers/ledger_contract.py) on the embedded SQLite ledger; the same
tests run on PostgreSQL in tests/integration/test_ledger_contract_postgres.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.env import sqlite_url
from tests.helpers.ledger_contract import *  # noqa: F403 -- the contract's tests, collected here


@pytest.fixture
def ledger(sqlite_ledger: str) -> str:
    return sqlite_ledger


@pytest.fixture
def empty_database(tmp_path: Path) -> str:
    return sqlite_url(tmp_path / "m.db")
