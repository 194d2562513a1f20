"""Every error response is JSON; library errors map to HTTP statuses here. The job API answers
{error, message}; the OpenAI-compatible routes (/v1/files, /v1/batches) answer OpenAI's envelope
{"error": {message, type, param, code[, line]}}, so the official SDK's exceptions carry them."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchinf.errors import (
    BatchinfError,
    BundleError,
    LedgerError,
    ManifestError,
    NotFoundError,
    TransientError,
)

log = logging.getLogger("batchinf.api")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


OPENAI_PATHS = ("/v1/files", "/v1/batches")
# OpenAI's error types by status; anything else of 4xx is an invalid request.
OPENAI_TYPES = {401: "invalid_request_error", 403: "permission_error", 429: "rate_limit_error"}


def body(code: str, message: str) -> dict[str, str]:
    return {"error": code, "message": message}


def error_body(path: str, status: int, code: str, message: str, param: str | None = None,
               line: int | None = None) -> dict[str, Any]:
    """The error document for a request to `path`: OpenAI's envelope on its routes, ours elsewhere."""
    if not path.startswith(OPENAI_PATHS):
        return body(code, message)
    kind = "server_error" if status >= 500 else OPENAI_TYPES.get(status, "invalid_request_error")
    code = "invalid_api_key" if status == 401 else code      # OpenAI's code for a missing or wrong key
    error: dict[str, Any] = {"message": message, "type": kind, "param": param, "code": code}
    if line is not None:
        error["line"] = line
    return {"error": error}


def _json(request: Request, status: int, code: str, message: str, headers: dict[str, str] | None = None,
          param: str | None = None, line: int | None = None) -> JSONResponse:
    return JSONResponse(error_body(request.url.path, status, code, message, param, line),
                        status_code=status, headers=headers)


def _where(error: dict[str, Any]) -> str:
    return ".".join(str(x) for x in error.get("loc", ()) if x != "body")


def _validation_message(exc: RequestValidationError) -> str:
    return "; ".join(f"{_where(e)}: {e.get('msg')}" for e in exc.errors()[:5]) or "invalid request"


def _validation_param(exc: RequestValidationError) -> str | None:
    """The first field at fault, without its location ("query.limit" -> "limit")."""
    first = exc.errors()[:1]
    return _where(first[0]).split(".", 1)[-1] or None if first else None


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return _json(request, exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _json(request, 422, "invalid_request", _validation_message(exc), param=_validation_param(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _json(request, exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(BatchinfError)
    async def _batchinf(request: Request, exc: BatchinfError) -> JSONResponse:
        status, code, message = _status_of(exc)
        return _json(request, status, code, message, param=exc.param, line=exc.line)

    @app.exception_handler(DataError)
    async def _data(request: Request, exc: DataError) -> JSONResponse:
        return _json(request, 422, "invalid_value", "a value cannot be stored (out of range, or a NUL or other "
                     f"control character): {str(exc.orig).splitlines()[0] if exc.orig else exc}")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _json(request, 500, "internal", "internal error; the server log has the details")


def _status_of(exc: BatchinfError) -> tuple[int, str, str]:
    if isinstance(exc, NotFoundError):
        return 404, "not_found", str(exc)
    if isinstance(exc, TransientError):
        return 503, "unavailable", f"{exc}; retry shortly"
    if isinstance(exc, (ManifestError, BundleError)):
        return 422, "invalid_manifest", str(exc)
    if isinstance(exc, LedgerError):
        return 409, "conflict", str(exc)
    return 400, "bad_request", str(exc)
