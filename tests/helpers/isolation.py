"""What keeps the unit suite unit: while a unit test (its set-up, call or tear-down) runs, reaching
a service or loading a reference implementation fails loudly instead of quietly working (or quietly
skipping) on a developer's machine that happens to have PostgreSQL, an S3 server or transformers.

One audit hook (sys.addaudithook, installed once per process, active only inside `guarded()`) refuses:
  * a TCP connection (IPv4 or IPv6, loopback included): PostgreSQL, Redis, RabbitMQ, S3, HTTP;
  * starting a server process (`batchinf serve|worker|controller|scheduler`, moto, redis-server,
    PostgreSQL, RabbitMQ);
  * importing a service client or a reference implementation (FORBIDDEN_MODULES).
The refusal raises at the offending call; if library code swallows it, `guarded()` still raises
when the phase ends, listing what was attempted.

Tests that need any of these belong in tests/integration (services, real models) or tests/parity
(reference implementations on tiny random models).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import pytest

# Service clients, and the reference implementations the parity tests compare against.
FORBIDDEN_MODULES = ("transformers", "sentence_transformers", "gguf", "psycopg", "psycopg2", "redis", "moto")
# argv words that start a server (or a process that reaches one) when they appear in a subprocess.
SERVER_COMMANDS = {"serve", "worker", "controller", "scheduler"}
SERVER_PROGRAMS = {"moto_server", "redis-server", "pg_ctl", "pg_ctlcluster", "postgres", "initdb", "rabbitmq-server"}
SERVER_MODULES = {"moto.server"}


class ServiceAccessError(RuntimeError):
    """A unit test tried to reach a service or import a reference implementation."""


class _State:
    active = False
    attempts: list[str] = []
    lock = threading.Lock()
    installed = False


def forbidden_imported(modules: Iterable[str] | None = None) -> list[str]:
    """The forbidden top-level modules present in `modules` (default: sys.modules)."""
    names = sys.modules if modules is None else set(modules)
    return sorted(m for m in FORBIDDEN_MODULES if m in names)


def _refuse(what: str) -> None:
    with _State.lock:
        _State.attempts.append(what)
    raise ServiceAccessError(f"the unit suite must not {what}; move the test to tests/integration "
                             "(services, real models) or tests/parity (reference implementations)")


def _server_argv(args: object) -> str | None:
    argv = [os.fsdecode(a) for a in args] if isinstance(args, (list, tuple)) else os.fsdecode(args).split()
    text = " ".join(argv)
    names = {os.path.basename(a) for a in argv}
    modules = {b for a, b in zip(argv, argv[1:]) if a == "-m"}
    if names & SERVER_PROGRAMS or modules & SERVER_MODULES:
        return text
    if ("batchinf.cli" in modules or "batchinf" in names) and SERVER_COMMANDS & set(argv):
        return text
    return None


def _hook(event: str, args: tuple) -> None:
    if not _State.active:
        return
    if event == "socket.connect":
        sock, address = args
        if getattr(sock, "family", None) in (socket.AF_INET, socket.AF_INET6):
            _refuse(f"connect to {address!r} (a network service)")
    elif event == "import":
        top = str(args[0]).partition(".")[0]
        if top in FORBIDDEN_MODULES:
            _refuse(f"import {args[0]!r}")
    elif event == "subprocess.Popen":
        cmd = _server_argv(args[1])
        if cmd is not None:
            _refuse(f"start a server process ({cmd})")


def install() -> None:
    """Install the audit hook (once per process; it does nothing until `guarded()` is entered)."""
    if not _State.installed:
        sys.addaudithook(_hook)
        _State.installed = True


@contextmanager
def guarded(where: str, *, raise_at_end: bool = True) -> Iterator[list[str]]:
    """Refuse services and reference imports inside the block. Yields the list of what was tried;
    unless `raise_at_end` is false, raises at the end of the block if anything was."""
    install()
    tried: list[str] = []
    with _State.lock:
        _State.attempts = tried
    _State.active = True
    try:
        yield tried
    finally:
        _State.active = False
    if tried and raise_at_end:
        raise ServiceAccessError(f"{where} tried to: {'; '.join(dict.fromkeys(tried))}")


# --- the unit suite's hooks (tests/unit/conftest.py) ----------------------------------------------

SESSION_IMPORTS = pytest.StashKey[frozenset]()


def collect_guarded(collector: pytest.Collector) -> Iterator[None]:
    """Body of a pytest_make_collect_report wrapper: importing a unit test module may not pull in a
    forbidden module either; if it tried (and the import was not already refused), the collector's
    report fails."""
    with guarded(collector.nodeid, raise_at_end=False) as tried:
        report = yield
    if tried and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = f"collecting {collector.nodeid} tried to: {'; '.join(dict.fromkeys(tried))}"
    return report


def remember_session_imports(config: pytest.Config) -> None:
    """At the end of collection: what the session imported (conftests, helpers, test modules)."""
    config.stash[SESSION_IMPORTS] = frozenset(m.partition(".")[0] for m in list(sys.modules))


def session_imports(config: pytest.Config) -> frozenset:
    return config.stash[SESSION_IMPORTS]
