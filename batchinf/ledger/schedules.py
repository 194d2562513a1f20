"""Schedules and their runs: one row per (schedule, logical date), guarded by a unique key."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError

from batchinf.errors import LedgerError
from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.tables import schedule_runs, schedules


def add(values: dict[str, Any]) -> None:
    try:
        with tx() as conn:
            conn.execute(insert(schedules).values(**values))
    except IntegrityError:
        raise LedgerError(f"schedule {values['name']!r} exists; pick another name") from None


def get(name: str) -> Any:
    with tx() as conn:
        row = conn.execute(select(schedules).where(schedules.c.name == name)).first()
    if row is None:
        raise LedgerError(f"no schedule {name!r}; see `batchinf schedule list`")
    return row


def listing(tenant: str | None = None, name: str | None = None, *, unpaused: bool = False
            ) -> list[tuple[Any, int, str | None]]:
    """(schedule row, run count, last logical date) by name."""
    q = select(schedules).order_by(schedules.c.name)
    for col, value in ((schedules.c.tenant, tenant), (schedules.c.name, name)):
        if value is not None:
            q = q.where(col == value)
    if unpaused:
        q = q.where(schedules.c.paused.is_(False))
    with tx() as conn:
        rows = conn.execute(q).all()
        stats = {s: (n, last) for s, n, last in conn.execute(
            select(schedule_runs.c.schedule, func.count(), func.max(schedule_runs.c.ds))
            .group_by(schedule_runs.c.schedule)).all()}
    return [(r, *stats.get(r.name, (0, None))) for r in rows]


def set_paused(name: str, paused: bool) -> None:
    with tx() as conn:
        conn.execute(update(schedules).where(schedules.c.name == name).values(paused=paused))


def runs(name: str) -> dict[str, str]:
    """Logical date -> job id."""
    with tx() as conn:
        return dict(conn.execute(select(schedule_runs.c.ds, schedule_runs.c.job_id)
                                 .where(schedule_runs.c.schedule == name)).all())


def record_run(name: str, ds: str, job_id: str) -> None:
    """Record the date's job; another scheduler recording it first is fine (same job)."""
    try:
        with tx() as conn:
            conn.execute(insert(schedule_runs).values(schedule=name, ds=ds, job_id=job_id, created_at=now()))
    except IntegrityError:
        pass
