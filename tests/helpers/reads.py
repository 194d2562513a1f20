"""Count what a job costs the ledger: job rows read (`Job.from_row`: a row and its JSON) and SQL
statements (SELECTs, and those reading the `jobs` table among them), in this process and in
the worker processes it spawns. Each process appends one line per event to its own file under a
directory, so a worker killed at the end of a job has already recorded what it did."""

from __future__ import annotations

import importlib
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Callable

JOBS_TABLE = re.compile(r"\b(FROM|JOIN)\s+jobs\b", re.IGNORECASE)


def install(directory: Path) -> Callable[[], None]:
    """Start counting in this process; returns what stops it."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    from batchinf.ledger import models

    out = open(directory / f"{os.getpid()}.log", "a", buffering=1)
    real = models.Job.__dict__["from_row"]

    def from_row(cls: type, row: Any) -> Any:
        out.write("job_row\n")
        return real.__func__(cls, row)

    def statement(conn: Any, cursor: Any, sql: str, params: Any, context: Any, many: bool) -> None:
        if not sql.lstrip().upper().startswith(("SELECT", "WITH")):
            out.write("statement\n")       # a write, BEGIN, a PRAGMA
        else:
            out.write("select_jobs\n" if JOBS_TABLE.search(sql) else "select\n")

    models.Job.from_row = classmethod(from_row)  # type: ignore[method-assign,assignment]
    event.listen(Engine, "before_cursor_execute", statement)

    def stop() -> None:
        models.Job.from_row = real  # type: ignore[method-assign]
        event.remove(Engine, "before_cursor_execute", statement)
        out.close()
    return stop


def counted(directory: str, target: str, *args: Any) -> None:
    """A spawned process's entry point that counts, then runs `target` ("module:function")."""
    install(Path(directory))
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(*args)


def totals(directory: Path) -> Counter[str]:
    """Every process's events, summed: job_row; select_jobs (a SELECT reading `jobs`), select
(another SELECT), statement (any other statement)."""
    c: Counter[str] = Counter()
    for f in directory.glob("*.log"):
        c.update(line.strip() for line in f.read_text().splitlines() if line.strip())
    return c
