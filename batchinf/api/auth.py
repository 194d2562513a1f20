"""Bearer tokens -> tenant. Every /v1 request is scoped to its token's tenant."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from batchinf.api.errors import ApiError
from batchinf.config import settings
from batchinf.tenants import authenticate

bearer = HTTPBearer(auto_error=False, description="a token from `batchinf token create --tenant NAME`")


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def current_tenant(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
    if creds is None:
        raise _unauthorized("missing bearer token; send 'Authorization: Bearer <token>' with a token "
                            "from `batchinf token create --tenant NAME`")
    tenant = authenticate(creds.credentials)
    if tenant is None:
        raise _unauthorized("invalid or revoked token; create one with `batchinf token create --tenant NAME`")
    return tenant


Tenant = Annotated[str, Depends(current_tenant)]


def check_metrics_token(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
    """/metrics lists every tenant's jobs: it needs the bearer token in BATCHINF_METRICS_TOKEN, unless
    the operator opened it with BATCHINF_METRICS_PUBLIC=1. With neither set it answers 401."""
    s = settings()
    if s.metrics_token:
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), s.metrics_token.encode()):
            raise _unauthorized("/metrics needs the bearer token set in BATCHINF_METRICS_TOKEN")
    elif not s.metrics_public:
        raise _unauthorized("/metrics lists every tenant's jobs, so it is closed until the operator sets "
                            "BATCHINF_METRICS_TOKEN (then scrape with that bearer token) or "
                            "BATCHINF_METRICS_PUBLIC=1 (open to anyone who reaches this port)")
