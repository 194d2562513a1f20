"""Engines, transactions and schema upgrades for the ledger (SQLite embedded, PostgreSQL distributed)."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import Connection, Engine, create_engine, event, inspect, text
from sqlalchemy.exc import DBAPIError, OperationalError

from batchinf.config import settings
from batchinf.errors import ConfigError, TransientError

_engines: dict[tuple[int, str], Engine] = {}


def migrations_dir() -> Path:
    """The Alembic scripts: batchinf.migrations (found, not imported: its env.py runs under Alembic)."""
    import importlib.util

    spec = importlib.util.find_spec("batchinf.migrations")
    assert spec is not None and spec.submodule_search_locations, "batchinf.migrations is missing from this install"
    return Path(list(spec.submodule_search_locations)[0])


def _sqlite_engine(url: str) -> Engine:
    path = url.removeprefix("sqlite:///")
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": 60, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # noqa: ANN001
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (see _on_begin)
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # noqa: ANN001
        # IMMEDIATE takes the write lock up front, so read-then-update transactions (claiming
        # a shard) serialize instead of failing with "database is locked" on upgrade.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def engine(url: str | None = None) -> Engine:
    """One engine per process and URL (engines must not cross a fork)."""
    url = url or settings().database_url
    key = (os.getpid(), url)
    if key not in _engines:
        if url.startswith("sqlite"):
            _engines[key] = _sqlite_engine(url)
        else:
            if url.startswith("postgresql://"):
                url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
            try:
                _engines[key] = create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)
            except ModuleNotFoundError as exc:
                extra = " install batchinf[postgres] (psycopg)" if "psycopg" in str(exc) else ""
                raise ConfigError(f"BATCHINF_DATABASE_URL {url.split('@')[-1]} needs {exc.name}, which is not "
                                  f"installed:{extra or ' install it'}") from exc
        if url.startswith("sqlite"):
            ensure_schema(_engines[key])
    return _engines[key]


def dispose_all() -> None:
    for e in _engines.values():
        e.dispose()
    _engines.clear()


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, OperationalError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


@contextmanager
def tx(url: str | None = None) -> Iterator[Connection]:
    """One ledger transaction. Connection-level faults become TransientError, which callers
    retry with `retrying` (or, in loops, on their next pass)."""
    eng = engine(url)
    try:
        with eng.begin() as conn:
            yield conn
    except (OperationalError, DBAPIError) as exc:
        if _is_transient(exc):
            raise TransientError(f"ledger unavailable: {exc.__class__.__name__}: {exc.orig}") from exc
        raise


def ping() -> None:
    """One round trip to the ledger; raises when it is unreachable."""
    with tx() as conn:
        conn.execute(text("SELECT 1"))


def alembic_config(url: str):  # noqa: ANN201
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def _server_admin(server_url: str) -> Engine:
    """An autocommit engine on a PostgreSQL server's `postgres` database (CREATE/DROP DATABASE)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(server_url.replace("postgresql://", "postgresql+psycopg://", 1))
    return create_engine(urlunsplit((parts.scheme, parts.netloc, "/postgres", parts.query, "")),
                         isolation_level="AUTOCOMMIT")


def create_database(server_url: str, name: str) -> None:
    """A new, empty PostgreSQL database `name` (letters, digits, _) on the server."""
    _on_server(server_url, f'CREATE DATABASE "{name}"', name)


def drop_database(server_url: str, name: str) -> None:
    """Drop the database (closing its connections); a server that is gone has nothing to drop."""
    try:
        _on_server(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', name)
    except OperationalError:
        pass


def _on_server(server_url: str, sql: str, name: str) -> None:
    assert re.fullmatch(r"[a-z0-9_]+", name), name
    admin = _server_admin(server_url)
    try:
        with admin.connect() as conn:
            conn.execute(text(sql))
    finally:
        admin.dispose()


def _raw_engine(url: str) -> Engine:
    """An engine that does not upgrade the schema on first use (embedded SQLite does)."""
    if url.startswith("sqlite"):
        return _sqlite_engine(url)
    return engine(url)


def _migrate(direction: str, revision: str, url: str | None) -> str:
    """Run Alembic's `upgrade` or `downgrade` to `revision`; returns the revision now current."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    url = url or settings().database_url
    eng = _raw_engine(url)
    with eng.connect() as conn:
        cfg = alembic_config(url)
        cfg.attributes["connection"] = conn
        getattr(command, direction)(cfg, revision)
        if conn.in_transaction():
            conn.commit()
        current = MigrationContext.configure(conn).get_current_revision()
    if url.startswith("sqlite"):
        eng.dispose()
    return current or ""


def upgrade(url: str | None = None, revision: str = "head") -> str:
    """Run Alembic migrations up to `revision`; returns the revision now current."""
    return _migrate("upgrade", revision, url)


def downgrade(revision: str, url: str | None = None) -> str:
    """Run Alembic downgrades to `revision` (e.g. "0006" or "-1"); returns the revision now current.
    An embedded SQLite ledger upgrades itself again on its next use."""
    return _migrate("downgrade", revision, url)


def state(url: str | None = None) -> dict[str, Any]:
    """{"current": the ledger's revision (None: empty), "head": this batchinf's, "up_to_date"}."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    url = url or settings().database_url
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    eng = _raw_engine(url)
    try:
        with eng.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    finally:
        if url.startswith("sqlite"):
            eng.dispose()
    return {"current": current, "head": head, "up_to_date": current == head}


def history() -> list[dict[str, Any]]:
    """The migrations this batchinf ships, oldest first."""
    from alembic.script import ScriptDirectory

    scripts = ScriptDirectory.from_config(alembic_config(settings().database_url))
    return [{"revision": sc.revision, "down_revision": sc.down_revision, "doc": sc.doc}
            for sc in reversed(list(scripts.walk_revisions()))]


_REVISION_LINE = re.compile(r"^(revision|down_revision) = (?:'([0-9A-Za-z_]+)'|None)$", re.M)


def script_head() -> str | None:
    """The migrations' head read from their `revision = '…'` and `down_revision = '…'` lines,
    without importing Alembic (a quarter of a second per process); None when a script says it
    otherwise (Alembic decides then)."""
    revisions, parents = set(), set()
    for path in (migrations_dir() / "versions").glob("[!_]*.py"):
        lines = dict(_REVISION_LINE.findall(path.read_text()))
        if set(lines) != {"revision", "down_revision"} or not lines["revision"]:
            return None
        revisions.add(lines["revision"])
        parents.add(lines["down_revision"])
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else None


def ensure_schema(eng: Engine) -> None:
    """Embedded mode creates and upgrades its SQLite ledger on first use."""
    with eng.connect() as conn:
        current = None
        if inspect(conn).has_table("alembic_version"):
            current = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
        conn.rollback()
    if current is not None and current == script_head():
        return
    from alembic.script import ScriptDirectory

    if current != ScriptDirectory.from_config(alembic_config(str(eng.url))).get_current_head():
        upgrade(eng.url.render_as_string(hide_password=False))
