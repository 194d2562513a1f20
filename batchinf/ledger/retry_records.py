"""The records a retry job selects: the old job's error rows by code, its not-done shards' staged
files, and the selection the retry job plans (`retry_records`)."""

from __future__ import annotations

from sqlalchemy import func, select

from batchinf.ledger.db import tx
from batchinf.ledger.states import SHARD_DONE, values
from batchinf.ledger.tables import record_errors, retry_records, shards


def error_records(job_id: str, codes: list[str] | None) -> list[tuple[str, int]]:
    """(source, ordinal) of the job's committed error rows of these codes (None: every code) that
    running can change: not the input errors (see `input_error_counts`)."""
    e = record_errors.c
    q = (select(e.source, e.ordinal).join(shards, shards.c.id == e.shard_id)
         .where(e.job_id == job_id, shards.c.bucket >= 0))
    if codes is not None:
        q = q.where(e.error.in_(codes))
    with tx() as conn:
        return [(src, int(o)) for src, o in conn.execute(q).all()]


def input_error_counts(job_id: str) -> dict[str, int]:
    """The job's input errors by code: the records planning refused (malformed JSON, no id, empty
    text, ...), committed by its validation shards (bucket < 0). The same pinned input and bundle
    give the same errors again, so a retry does not run them."""
    e = record_errors.c
    q = (select(e.error, func.count()).join(shards, shards.c.id == e.shard_id)
         .where(e.job_id == job_id, shards.c.bucket < 0).group_by(e.error).order_by(e.error))
    with tx() as conn:
        return {code: int(n) for code, n in conn.execute(q).all()}


def unfinished_shard_files(job_id: str) -> list[str]:
    """Staged files of the job's shards that are not done (neither committed nor quarantined):
    the records nobody accounted for."""
    with tx() as conn:
        return list(conn.execute(select(shards.c.input_uri).where(
            shards.c.job_id == job_id, shards.c.status.not_in(values(SHARD_DONE)))
            .order_by(shards.c.bucket, shards.c.ordinal)).scalars())


def has_shards(job_id: str) -> bool:
    with tx() as conn:
        return conn.execute(select(shards.c.id).where(shards.c.job_id == job_id).limit(1)).first() is not None


def selects(job_id: str) -> bool:
    """Whether the job plans only selected records (a retry job's `selection`)."""
    with tx() as conn:
        return conn.execute(select(retry_records.c.job_id).where(retry_records.c.job_id == job_id).limit(1)
                            ).first() is not None


def kept(job_id: str, source: str) -> set[int]:
    """`selection(job_id).get(source, set())` for one object, read by its own rows (a job that
    `selects`)."""
    with tx() as conn:
        return {int(o) for o in conn.execute(select(retry_records.c.ordinal).where(
            retry_records.c.job_id == job_id, retry_records.c.source == source)).scalars()}


def selection(job_id: str) -> dict[str, set[int]] | None:
    """The records a retry job plans, by source uri; None when it plans every pinned record."""
    with tx() as conn:
        rows = conn.execute(select(retry_records.c.source, retry_records.c.ordinal)
                            .where(retry_records.c.job_id == job_id)).all()
    if not rows:
        return None
    out: dict[str, set[int]] = {}
    for src, o in rows:
        out.setdefault(src, set()).add(int(o))
    return out
