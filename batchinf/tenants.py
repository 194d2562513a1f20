"""Tenants and their API bearer tokens. A token is shown once at creation; the ledger keeps only
its sha256, so a stolen database does not yield usable tokens."""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Any

from sqlalchemy import func, insert, select, update

from batchinf.errors import LedgerError
from batchinf.ledger.db import tx
from batchinf.ledger.ops import now
from batchinf.ledger.tables import api_tokens

DEFAULT_TENANT = "default"
TOKEN_PREFIX = "bi_"
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def check_tenant(name: str) -> str:
    if not _TENANT.match(name or ""):
        raise LedgerError(f"tenant {name!r} is not a valid name; use 1-100 letters, digits, '.', '_' "
                          "or '-', starting with a letter or digit")
    return name


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(tenant: str, name: str | None = None) -> dict[str, Any]:
    """A new bearer token for `tenant`; the returned dict is the only place the token appears."""
    check_tenant(tenant)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token_id = "tok-" + secrets.token_hex(6)
    t = now()
    with tx() as conn:
        conn.execute(insert(api_tokens).values(id=token_id, tenant=tenant, name=name,
                                               token_sha256=token_hash(token), created_at=t))
    return {"id": token_id, "tenant": tenant, "name": name, "token": token, "created_at": t}


def list_tokens(tenant: str | None = None) -> list[dict[str, Any]]:
    q = select(api_tokens.c.id, api_tokens.c.tenant, api_tokens.c.name, api_tokens.c.created_at,
               api_tokens.c.last_used_at, api_tokens.c.revoked_at).order_by(api_tokens.c.created_at)
    if tenant is not None:
        q = q.where(api_tokens.c.tenant == tenant)
    with tx() as conn:
        return [dict(r._mapping) for r in conn.execute(q).all()]


def revoke_token(token_id: str) -> dict[str, Any]:
    with tx() as conn:
        res = conn.execute(update(api_tokens).where(api_tokens.c.id == token_id,
                                                    api_tokens.c.revoked_at.is_(None))
                           .values(revoked_at=now()))
        row = conn.execute(select(api_tokens.c.id, api_tokens.c.tenant, api_tokens.c.revoked_at)
                           .where(api_tokens.c.id == token_id)).first()
    if row is None:
        raise LedgerError(f"no token {token_id!r}; see `batchinf token list`")
    return {"id": row.id, "tenant": row.tenant, "revoked_at": row.revoked_at, "changed": res.rowcount == 1}


def authenticate(token: str) -> str | None:
    """The tenant of a valid, unrevoked token; None otherwise."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    with tx() as conn:
        row = conn.execute(select(api_tokens.c.id, api_tokens.c.tenant).where(
            api_tokens.c.token_sha256 == token_hash(token), api_tokens.c.revoked_at.is_(None))).first()
        if row is None:
            return None
        t = now()
        conn.execute(update(api_tokens).where(   # at most once a minute: no write per request
            api_tokens.c.id == row.id, func.coalesce(api_tokens.c.last_used_at, 0) < t - 60)
            .values(last_used_at=t))
    return row.tenant
