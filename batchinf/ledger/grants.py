"""Tenants' storage grants (prefixes they may read or write) and their operator-set limits."""

from __future__ import annotations

from sqlalchemy import delete, func, insert, or_, select

from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.tables import jobs, tenant_grants, tenant_limits


def grant(tenant: str, prefix: str, mode: str) -> None:
    with tx() as conn:
        if conn.execute(select(tenant_grants.c.tenant).where(
                tenant_grants.c.tenant == tenant, tenant_grants.c.prefix == prefix,
                tenant_grants.c.mode == mode)).first() is None:
            conn.execute(insert(tenant_grants).values(tenant=tenant, prefix=prefix, mode=mode, created_at=now()))


def revoke(tenant: str, prefix: str) -> int:
    with tx() as conn:
        return conn.execute(delete(tenant_grants).where(tenant_grants.c.tenant == tenant,
                                                        tenant_grants.c.prefix == prefix)).rowcount


def of_tenant(tenant: str) -> list[tuple[str, str]]:
    """(prefix, mode) of the tenant's grants."""
    with tx() as conn:
        return [tuple(r) for r in conn.execute(select(tenant_grants.c.prefix, tenant_grants.c.mode)
                                               .where(tenant_grants.c.tenant == tenant)
                                               .order_by(tenant_grants.c.prefix, tenant_grants.c.mode)).all()]


def set_limit(tenant: str, name: str, value: int | None) -> None:
    """Set (or with None, remove) one of the tenant's limits."""
    with tx() as conn:
        conn.execute(delete(tenant_limits).where(tenant_limits.c.tenant == tenant, tenant_limits.c.name == name))
        if value is not None:
            conn.execute(insert(tenant_limits).values(tenant=tenant, name=name, value=value))


def limits_of(tenant: str) -> dict[str, int]:
    with tx() as conn:
        return dict(conn.execute(select(tenant_limits.c.name, tenant_limits.c.value)
                                 .where(tenant_limits.c.tenant == tenant)).all())


def overlapping_jobs(prefix: str) -> list[tuple[str, str, str, str, str]]:
    """Jobs (any tenant, any state) whose output or input prefix shares a leading part with
    `prefix`, as (id, tenant, status, which, uri) with which = output | input: the candidates
    that may equal, contain or lie inside it (the caller compares path segments exactly)."""
    out = []
    with tx() as conn:
        for col, which in ((jobs.c.output_uri, "output"), (jobs.c.input_uri, "input")):
            rows = conn.execute(select(jobs.c.id, jobs.c.tenant, jobs.c.status, col).where(or_(
                func.substr(prefix, 1, func.length(col)) == col,
                func.substr(col, 1, len(prefix)) == prefix)).order_by(jobs.c.created_at)).all()
            out += [(r[0], r[1], r[2], which, r[3]) for r in rows]
    return out
