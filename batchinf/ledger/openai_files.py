"""Files and batches of the OpenAI-compatible API (`files`, `batches`), scoped by tenant: a row of
another tenant reads exactly like a missing one (None)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, func, insert, or_, select, update

from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.tables import batches, files, job_events, shards


def add_file(values: dict[str, Any]) -> None:
    with tx() as conn:
        conn.execute(insert(files).values(**values))


def get_file(file_id: str, tenant: str) -> dict[str, Any] | None:
    with tx() as conn:
        row = conn.execute(select(files).where(files.c.id == file_id, files.c.tenant == tenant,
                                               files.c.deleted_at.is_(None))).first()
    return dict(row._mapping) if row else None


def list_files(tenant: str, *, purpose: str | None = None, after: str | None = None,
               limit: int = 10000) -> list[dict[str, Any]]:
    """Newest first; `after` is the id of the last file of the previous page."""
    q = select(files).where(files.c.tenant == tenant, files.c.deleted_at.is_(None))
    if purpose:
        q = q.where(files.c.purpose == purpose)
    with tx() as conn:
        if after:
            ref = conn.execute(select(files.c.created_at).where(files.c.id == after,
                                                                files.c.tenant == tenant)).scalar()
            if ref is not None:
                q = q.where(or_(files.c.created_at < ref, and_(files.c.created_at == ref, files.c.id < after)))
        rows = conn.execute(q.order_by(files.c.created_at.desc(), files.c.id.desc()).limit(limit)).all()
    return [dict(r._mapping) for r in rows]


def delete_file(file_id: str, tenant: str) -> bool:
    with tx() as conn:
        res = conn.execute(update(files).where(files.c.id == file_id, files.c.tenant == tenant,
                                               files.c.deleted_at.is_(None)).values(deleted_at=now()))
    return res.rowcount == 1


def add_batch(values: dict[str, Any]) -> None:
    with tx() as conn:
        conn.execute(insert(batches).values(**values))


def get_batch(batch_id: str, tenant: str) -> dict[str, Any] | None:
    with tx() as conn:
        row = conn.execute(select(batches).where(batches.c.id == batch_id, batches.c.tenant == tenant)).first()
    return dict(row._mapping) if row else None


def page_batches(tenant: str, *, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
    """A page of this tenant's batches, newest first, after the batch `after`; (rows, has_more)."""
    q = select(batches).where(batches.c.tenant == tenant)
    with tx() as conn:
        if after:
            ref = conn.execute(select(batches.c.created_at).where(batches.c.id == after,
                                                                  batches.c.tenant == tenant)).scalar()
            if ref is not None:
                q = q.where(or_(batches.c.created_at < ref,
                                and_(batches.c.created_at == ref, batches.c.id < after)))
        rows = conn.execute(q.order_by(batches.c.created_at.desc(), batches.c.id.desc()).limit(limit + 1)).all()
    return [dict(r._mapping) for r in rows[:limit]], len(rows) > limit


def update_batch(batch_id: str, **fields: Any) -> None:
    with tx() as conn:
        conn.execute(update(batches).where(batches.c.id == batch_id).values(**fields))


def finalize_batch(batch_id: str, output_file: dict[str, Any] | None, error_file: dict[str, Any] | None) -> bool:
    """Record a finished batch's output and error files once (False when already done)."""
    with tx() as conn:
        res = conn.execute(update(batches).where(batches.c.id == batch_id, batches.c.finalized_at.is_(None))
                           .values(finalized_at=now(), output_file_id=output_file and output_file["id"],
                                   error_file_id=error_file and error_file["id"]))
        if res.rowcount != 1:
            return False
        for f in (output_file, error_file):
            if f is not None:
                conn.execute(insert(files).values(**f))
    return True


def entered_at(job_id: str) -> dict[str, float]:
    """When the job first entered each status (from the audit log)."""
    with tx() as conn:
        rows = conn.execute(select(job_events.c.to_status, func.min(job_events.c.at))
                            .where(job_events.c.job_id == job_id, job_events.c.kind == "job",
                                   job_events.c.to_status.is_not(None))
                            .group_by(job_events.c.to_status)).all()
    return {status: at for status, at in rows}


def output_tokens(job_id: str) -> int:
    """Generated tokens of the job's committed shards."""
    with tx() as conn:
        return int(conn.execute(select(func.coalesce(func.sum(shards.c.tokens_output), 0))
                                .where(shards.c.job_id == job_id)).scalar() or 0)
