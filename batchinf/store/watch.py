"""A watchdog over storage calls: a call running longer than BATCHINF_STORE_WARN_SECONDS is
logged with its job and object ("still waiting for s3 GET s3://b/k (job J) after 10 s"), and
again every as long, until it returns or times out (S3: BATCHINF_S3_READ_TIMEOUT per try, then a
TransientError). One daemon thread per process watches every call in flight; a call costs a
dictionary insert and delete.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from batchinf import logs
from batchinf.config import settings

log = logging.getLogger("batchinf.store")


@dataclass
class _Call:
    what: str               # "s3 GET s3://bucket/key"
    fields: dict[str, Any]  # the caller's log context (job_id, shard_id, attempt)
    started: float
    warn_at: float


_calls: dict[int, _Call] = {}
_ids = itertools.count()
_lock = threading.Lock()
_thread: list[threading.Thread | None] = [None]


def _reset_after_fork() -> None:
    """A forked child has no watchdog thread and none of its parent's calls."""
    global _lock
    _lock = threading.Lock()
    _calls.clear()
    _thread[0] = None


os.register_at_fork(after_in_child=_reset_after_fork)


@contextlib.contextmanager
def waiting(scheme: str, op: str, uri: str) -> Iterator[None]:
    """Watch the storage call inside: log it while it runs past the warning threshold."""
    warn = settings().store_warn_seconds
    if warn <= 0:
        yield
        return
    t = time.monotonic()
    call = _Call(f"{scheme} {op} {uri}", logs.current(), t, t + warn)
    key = next(_ids)
    with _lock:
        _calls[key] = call
        if _thread[0] is None or not _thread[0].is_alive():
            _thread[0] = threading.Thread(target=_watch, name="batchinf-store-watch", daemon=True)
            _thread[0].start()
    try:
        yield
    finally:
        with _lock:
            _calls.pop(key, None)
        took = time.monotonic() - t
        if took >= warn:
            log.info("%s%s returned after %.1f s", call.what, _job(call), took, extra=call.fields)


def _job(call: _Call) -> str:
    return f" (job {call.fields['job_id']})" if call.fields.get("job_id") else ""


def _watch() -> None:
    while True:
        warn = settings().store_warn_seconds
        time.sleep(max(0.05, min(1.0, warn / 4)))
        t = time.monotonic()
        with _lock:
            late = [c for c in _calls.values() if c.warn_at <= t]
            for c in late:
                c.warn_at = t + warn
        for c in late:
            log.warning("still waiting for %s%s after %.1f s", c.what, _job(c), t - c.started, extra=c.fields)
