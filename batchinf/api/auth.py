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
    """/metrics is open unless BATCHINF_METRICS_TOKEN is set; then that bearer token is required."""
    want = settings().metrics_token
    if want and (creds is None or not hmac.compare_digest(creds.credentials.encode(), want.encode())):
        raise _unauthorized("/metrics needs the bearer token set in BATCHINF_METRICS_TOKEN")
