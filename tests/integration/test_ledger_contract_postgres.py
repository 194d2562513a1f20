"""The ledger contract (tests/helpers/ledger_contract.py) on PostgreSQL, a fresh database per test;
the same tests run on SQLite in tests/unit/test_ledger_contract_sqlite.py."""

from __future__ import annotations

import pytest

from tests.helpers.ledger_contract import *  # noqa: F403 -- the contract's tests, collected here
from tests.helpers.services import fresh_postgres_db

pytestmark = pytest.mark.integration


@pytest.fixture
def ledger(postgres_ledger: str) -> str:
    return postgres_ledger


@pytest.fixture
def empty_database() -> str:
    return fresh_postgres_db()
