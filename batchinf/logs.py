"""Logging: one configuration and one formatter for batchinf, Celery and uvicorn.

`configure()` (called by the CLI's `--log-format` / `--log-level`, or BATCHINF_LOG_FORMAT /
BATCHINF_LOG_LEVEL) puts one handler on the root logger; Celery (`worker_hijack_root_logger` off,
its task loggers propagating) and uvicorn (`log_config=None`) log through it. In `json` format
every line is one JSON object: `ts`, `level`, `logger`, `message`, and `job_id` / `shard_id` where
they apply, taken from the record's `extra` or from `context()` (set around a lifecycle step and
a shard's execution), plus `exc` for a traceback.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from typing import Any, Iterator

from batchinf.config import settings

FIELDS = ("job_id", "shard_id", "attempt", "worker", "from_status", "to_status")
_context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("batchinf_log_context", default={})
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s%(context)s"


@contextlib.contextmanager
def context(**fields: Any) -> Iterator[None]:
    """Every record logged inside carries these fields (e.g. job_id, shard_id)."""
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def current() -> dict[str, Any]:
    """The fields `context()` set around this point (job_id, shard_id, ...), for a record logged
    on another thread's behalf."""
    return dict(_context.get())


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    out = dict(_context.get())
    for name in FIELDS:
        if getattr(record, name, None) is not None:
            out[name] = getattr(record, name)
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
            "process": record.process, **_fields(record)}
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        fields = _fields(record)
        record.context = "".join(f" {k}={v}" for k, v in fields.items())
        return super().format(record)


def formatter(fmt: str | None = None) -> logging.Formatter:
    return JsonFormatter() if (fmt or settings().log_format) == "json" else TextFormatter()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record (not the one at configure time)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:  # noqa: D401
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def configure(fmt: str | None = None, level: str | None = None) -> None:
    """One stderr handler on the root logger with batchinf's formatter (a second call replaces it;
    handlers others put there stay); Celery's and uvicorn's loggers propagate to it (their own
    handlers are removed)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, _StderrHandler):
            root.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(formatter(fmt))
    root.addHandler(handler)
    root.setLevel(level or settings().log_level or "INFO")
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "celery", "celery.task", "celery.worker",
                 "celery.redirected"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
