"""Running totals per job: shards and their sums by status, record errors by code, worker seconds.

The database keeps them (migration 0014's triggers on shards, record_errors and attempts), so no
code path can forget one and a bulk UPDATE counts like a single one. On PostgreSQL the triggers
append deltas (concurrent commits never wait on a shared counter row) and the running tick folds
a job's deltas into its totals (`compact`); every read sums totals and pending deltas in one
statement, so it is exact whether or not a fold ran. On SQLite the triggers update the totals.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable

from sqlalchemy import Connection, func, select, text, union_all

from batchinf.ledger.db import tx
from batchinf.ledger.states import ShardStatus
from batchinf.ledger.tables import TALLY_SUMS, job_tallies, job_tally_deltas


@dataclass
class Tally:
    n: int = 0
    records: int = 0
    output_rows: int = 0
    error_rows: int = 0
    tokens_input: int = 0
    tokens_real: int = 0
    tokens_padded: int = 0
    execute_seconds: float = 0.0
    worker_seconds: float = 0.0

    def add(self, other: "Tally") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class JobTallies:
    """One job's totals. `shards[status]` counts computed and validation-error shards together;
    `computed_errors` is the error rows of computed shards (committed, or a poison record)."""
    shards: dict[str, Tally]
    computed_errors: int
    errors_by_code: dict[str, int]
    worker_seconds: float      # of finished attempts

    def shard_sums(self, status: str) -> Tally:
        return self.shards.get(status, Tally())


def _summed(conn: Connection, by: tuple[str, ...], where: Any) -> list[Any]:
    """Totals plus pending deltas where `where` holds, summed per `by` columns, in one statement
    (a concurrent fold moves rows between the two tables atomically, so nothing counts twice)."""
    both = union_all(*(select(*(t.c[c] for c in by), *(t.c[s] for s in TALLY_SUMS)).where(where(t))
                       for t in (job_tallies, job_tally_deltas))).subquery()
    return conn.execute(select(*(both.c[c] for c in by), *(func.sum(both.c[s]) for s in TALLY_SUMS))
                        .group_by(*(both.c[c] for c in by))).all()


def _tally(sums: Iterable[Any]) -> Tally:
    return Tally(*(float(v) if s.endswith("seconds") else int(v) for s, v in zip(TALLY_SUMS, sums)))


def read(conn: Connection, job_ids: Iterable[str]) -> dict[str, JobTallies]:
    """Every given job's totals (jobs without any: empty ones), in one statement."""
    ids = list(job_ids)
    out = {i: JobTallies({}, 0, {}, 0.0) for i in ids}
    if not ids:
        return out
    for job_id, key, *sums in _summed(conn, ("job_id", "key"), lambda t: t.c.job_id.in_(ids)):
        t, kind, name, tally = out[job_id], key[:1], key[2:], _tally(sums)
        if kind in "sv":
            t.shards.setdefault(name, Tally()).add(tally)
            if kind == "s":
                t.computed_errors += tally.error_rows
        elif kind == "e" and tally.n:
            t.errors_by_code[name] = tally.n
        elif kind == "w":
            t.worker_seconds += tally.worker_seconds
    return out


def committed_by_job(conn: Connection) -> dict[str, Tally]:
    """Every job's committed shards, summed (computed and validation-error ones alike)."""
    keys = [f"{kind}:{ShardStatus.COMMITTED.value}" for kind in "sv"]
    return {job_id: _tally(sums) for job_id, *sums in _summed(conn, ("job_id",), lambda t: t.c.key.in_(keys))}


def errors_by_code(conn: Connection) -> list[tuple[str, int]]:
    """Record errors of every job by code, (code, count) sorted by code."""
    rows = _summed(conn, ("key",), lambda t: t.c.key.like("e:%"))
    return sorted((key[2:], int(n)) for key, n, *_ in rows if n)


def of_job(job_id: str) -> JobTallies:
    with tx() as conn:
        return read(conn, [job_id])[job_id]


_SUMS = ", ".join(TALLY_SUMS)
_COMPACT = text(
    f"WITH moved AS (DELETE FROM job_tally_deltas WHERE job_id = :job_id RETURNING job_id, key, {_SUMS}) "
    f"INSERT INTO job_tallies (job_id, key, {_SUMS}) "
    f"SELECT job_id, key, {', '.join(f'SUM({s})' for s in TALLY_SUMS)} FROM moved GROUP BY job_id, key "
    "ON CONFLICT (job_id, key) DO UPDATE SET "
    + ", ".join(f"{s} = job_tallies.{s} + excluded.{s}" for s in TALLY_SUMS))


def compact(job_id: str) -> None:
    """Fold the job's pending deltas into its totals (PostgreSQL; SQLite has none), in one
    statement: a concurrent read sees the deltas or the folded totals, never both or neither."""
    with tx() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(_COMPACT, {"job_id": job_id})
