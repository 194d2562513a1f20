"""The test environment, set up in one place: a fresh BATCHINF_HOME with fast leases, the reset of
batchinf's per-process caches around it, the ledger urls each backend uses, and the environment
handed to subprocesses (`batchinf serve`, workers, the scheduler)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from batchinf.scopes import Caller

# The caller of jobs a test creates as the operator's CLI would (tenant `default`).
OPERATOR = Caller("default", operator=True)
# Short leases and heartbeats so that lost workers are noticed within seconds in tests.
FAST_LEASES = {"BATCHINF_HEARTBEAT_SECONDS": "0.5", "BATCHINF_LEASE_SECONDS": "5"}
# Settings a test home must not inherit from the developer's shell (or from an earlier fixture).
INHERITED = ("BATCHINF_DATABASE_URL", "BATCHINF_BUNDLE_STORE")


def reset_process_state() -> None:
    """Forget what this process cached from the environment: settings, engines, loaded bundles."""
    from batchinf import bundles, config
    from batchinf.ledger import db

    config.settings.cache_clear()
    db.dispose_all()
    bundles._loaded.clear()


def use_home(mp: pytest.MonkeyPatch, home: Path, *, fast_leases: bool = True, **env: str) -> Path:
    """Point batchinf at a fresh `home` (embedded SQLite ledger, local bundle store) through `mp`,
    with fast leases and any extra `env` (BATCHINF_DATABASE_URL among them for another ledger);
    then reset the process state. `mp.undo()` and `reset_process_state()` put it back."""
    mp.setenv("BATCHINF_HOME", str(home))
    for name in INHERITED:
        mp.delenv(name, raising=False)
    for k, v in {**(FAST_LEASES if fast_leases else {}), **env}.items():
        mp.setenv(k, v)
    reset_process_state()
    return home


def use_database(mp: pytest.MonkeyPatch, url: str, *, upgrade: bool = True) -> str:
    """Switch the ledger to `url` (schema at head by Alembic unless `upgrade` is false)."""
    from batchinf.ledger import db

    mp.setenv("BATCHINF_DATABASE_URL", url)
    reset_process_state()
    if upgrade:
        db.upgrade(url)
    return url


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{path}"


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a `batchinf` subprocess: this process's (which the fixtures set up), plus `extra`."""
    return {**os.environ, **extra}
