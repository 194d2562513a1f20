"""The audit log: one `job_events` row per transition, written in the transition's transaction."""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import Connection, insert

from batchinf.ledger.tables import job_events


def now() -> float:
    return time.time()


def record(conn: Connection, job_id: str, kind: str, frm: str | None, to: str | None,
           shard_id: str | None = None, detail: Any = None) -> None:
    """kind: job | shard | attempt | note."""
    if detail is not None and not isinstance(detail, str):
        detail = json.dumps(detail, default=str)
    conn.execute(_INSERT, {"job_id": job_id, "shard_id": shard_id, "kind": kind, "from_status": frm,
                           "to_status": to, "detail": detail, "at": now()})


_INSERT = insert(job_events)     # built once: the hot paths' statements cost their execution only


def record_shards(conn: Connection, job_id: str, moves: list[tuple[str, str, str]]) -> None:
    """One `shard` event per (shard_id, from, to), in one statement (a bulk transition)."""
    if moves:
        t = now()
        conn.execute(insert(job_events), [{"job_id": job_id, "shard_id": sid, "kind": "shard", "from_status": frm,
                                           "to_status": to, "detail": None, "at": t} for sid, frm, to in moves])
