"""The unit suite runs with no service (no PostgreSQL, Redis, RabbitMQ or S3 server, no server
subprocess) and without transformers, sentence-transformers or gguf: importing a unit test module,
and every set-up, call and tear-down of a unit test, runs under tests.helpers.isolation.guarded(),
which refuses them loudly. What the session imported is remembered at the end of collection for
tests/unit/test_suite_layout.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import isolation


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[pytest.CollectReport]:
    return (yield from isolation.collect_guarded(collector))


def pytest_collection_finish(session: pytest.Session) -> None:
    isolation.remember_session_imports(session.config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with isolation.guarded(f"{item.nodeid} (set-up)"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with isolation.guarded(item.nodeid):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with isolation.guarded(f"{item.nodeid} (tear-down)"):
        return (yield)


@pytest.fixture(autouse=True)
def _no_service_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the shell (or an integration fixture earlier in the session) exported, a unit test
    sees no ledger, broker, bundle store or S3 endpoint but its own."""
    for name in ("BATCHINF_DATABASE_URL", "BATCHINF_BROKER_URL", "BATCHINF_BUNDLE_STORE", "BATCHINF_S3_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def ledger(sqlite_ledger: str) -> str:
    """The unit suite's ledger: embedded SQLite (the PostgreSQL run of the same contract is in
    tests/integration/test_ledger_contract_postgres.py)."""
    return sqlite_ledger
