"""How a local pool starts a worker (dispatch.start_method): forked from a driver that runs no
thread a fork would leave holding a lock and has loaded no library whose thread pools a fork
breaks, so the worker starts with the driver's imports; spawned otherwise."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from batchinf import dispatch


class Named:
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """This process as a driver before planning: the main thread, the store's watchdog, no unsafe module."""
    for m in dispatch.FORK_UNSAFE_MODULES:
        monkeypatch.delitem(sys.modules, m, raising=False)
    main = threading.main_thread()
    monkeypatch.setattr(threading, "enumerate", lambda: [main, Named("batchinf-store-watch")])
    return monkeypatch


def test_a_driver_with_nothing_a_fork_breaks_forks_its_workers(clean: pytest.MonkeyPatch) -> None:
    assert dispatch.start_method() == "fork"


@pytest.mark.parametrize("module", dispatch.FORK_UNSAFE_MODULES)
def test_a_driver_that_loaded_a_library_with_thread_pools_spawns(clean: pytest.MonkeyPatch, module: str) -> None:
    clean.setitem(sys.modules, module, object())
    assert dispatch.start_method() == "spawn"


def test_a_driver_running_another_thread_spawns(clean: pytest.MonkeyPatch) -> None:
    main = threading.main_thread()
    clean.setattr(threading, "enumerate", lambda: [main, Named("batchinf-store-watch"), Named("Thread-1 (refresh)")])
    assert dispatch.start_method() == "spawn"


def test_a_fresh_driver_process_forks_until_it_imports_torch() -> None:
    code = ("from batchinf.dispatch import start_method; a = start_method(); import torch; "
            "print(a, start_method())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["fork", "spawn"]
