"""The storage watchdog (store/watch.py): a call stuck past BATCHINF_STORE_WARN_SECONDS is logged
with its job and object while it runs, and its end is logged too. A real LocalStore, slowed by
the `store.get` failpoint."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from batchinf import failpoints, logs
from batchinf.config import settings
from batchinf.store import get_store


@pytest.fixture
def slow_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINF_STORE_WARN_SECONDS", "0.2")
    monkeypatch.setenv("BATCHINF_FAILPOINTS", "store.get=sleep(1.0)")
    settings.cache_clear()
    failpoints.reload()
    yield
    monkeypatch.undo()
    settings.cache_clear()
    failpoints.reload()


def test_a_stuck_store_call_is_logged_with_its_job_and_object(slow_reads: None, tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello")
    uri = (tmp_path / "a.txt").as_uri()
    store = get_store(uri)
    with caplog.at_level(logging.INFO, logger="batchinf.store"), logs.context(job_id="job-42"):
        assert store.get_bytes(uri) == b"hello"
        pin = store.head(uri)
        caplog.clear()
        with store.open_read(pin) as f:                 # watched while it opens (S3: while it downloads)
            assert f.read() == b"hello"
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still waiting for")]
    assert waits and all(m.startswith(f"still waiting for file GET {uri} (job job-42) after ") for m in waits), waits
    assert all(getattr(r, "job_id", None) == "job-42" for r in caplog.records)   # JSON logs carry the field too
    assert caplog.records[-1].getMessage().startswith(f"file GET {uri} (job job-42) returned after")


def test_a_quick_call_logs_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a.txt").write_bytes(b"x")
    with caplog.at_level(logging.INFO, logger="batchinf.store"):
        get_store(str(tmp_path / "a.txt")).get_bytes(str(tmp_path / "a.txt"))
    assert not caplog.records
