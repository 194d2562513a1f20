"""API tokens: only each token's sha256 is stored."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, insert, select, update

from batchinf.errors import LedgerError
from batchinf.ledger.db import tx
from batchinf.ledger.events import now
from batchinf.ledger.tables import api_tokens


def add(token_id: str, tenant: str, name: str | None, token_sha256: str, created_at: float) -> None:
    with tx() as conn:
        conn.execute(insert(api_tokens).values(id=token_id, tenant=tenant, name=name, token_sha256=token_sha256,
                                               created_at=created_at))


def listing(tenant: str | None = None) -> list[dict[str, Any]]:
    q = select(api_tokens.c.id, api_tokens.c.tenant, api_tokens.c.name, api_tokens.c.created_at,
               api_tokens.c.last_used_at, api_tokens.c.revoked_at).order_by(api_tokens.c.created_at)
    if tenant is not None:
        q = q.where(api_tokens.c.tenant == tenant)
    with tx() as conn:
        return [dict(r._mapping) for r in conn.execute(q).all()]


def revoke(token_id: str) -> dict[str, Any]:
    with tx() as conn:
        res = conn.execute(update(api_tokens).where(api_tokens.c.id == token_id, api_tokens.c.revoked_at.is_(None))
                           .values(revoked_at=now()))
        row = conn.execute(select(api_tokens.c.id, api_tokens.c.tenant, api_tokens.c.revoked_at)
                           .where(api_tokens.c.id == token_id)).first()
    if row is None:
        raise LedgerError(f"no token {token_id!r}; see `batchinf token list`")
    return {"id": row.id, "tenant": row.tenant, "revoked_at": row.revoked_at, "changed": res.rowcount == 1}


def tenant_of(token_sha256: str) -> str | None:
    """The tenant of an unrevoked token with this hash; its last use is recorded at most once a
    minute (no write per request)."""
    with tx() as conn:
        row = conn.execute(select(api_tokens.c.id, api_tokens.c.tenant).where(
            api_tokens.c.token_sha256 == token_sha256, api_tokens.c.revoked_at.is_(None))).first()
        if row is None:
            return None
        t = now()
        conn.execute(update(api_tokens).where(api_tokens.c.id == row.id,
                                              func.coalesce(api_tokens.c.last_used_at, 0) < t - 60)
                     .values(last_used_at=t))
    return row.tenant
