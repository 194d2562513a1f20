"""Tenants and their API bearer tokens. A token is shown once at creation; the ledger keeps only
its sha256, so a stolen database does not yield usable tokens."""

from __future__ import annotations

import hashlib
import re
import secrets
from typing import Any

from batchinf.errors import LedgerError
from batchinf.ledger import tokens
from batchinf.ledger.events import now

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
    tokens.add(token_id, tenant, name, token_hash(token), t)
    return {"id": token_id, "tenant": tenant, "name": name, "token": token, "created_at": t}


def list_tokens(tenant: str | None = None) -> list[dict[str, Any]]:
    return tokens.listing(tenant)


def revoke_token(token_id: str) -> dict[str, Any]:
    return tokens.revoke(token_id)


def authenticate(token: str) -> str | None:
    """The tenant of a valid, unrevoked token; None otherwise."""
    if not token.startswith(TOKEN_PREFIX):
        return None
    return tokens.tenant_of(token_hash(token))
