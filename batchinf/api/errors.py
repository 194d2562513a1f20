"""Every error response is JSON {error, message}; library errors map to HTTP statuses here."""

from __future__ import annotations

import logging

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


def body(code: str, message: str) -> dict[str, str]:
    return {"error": code, "message": message}


def _json(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body(code, message), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{where}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request"


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return _json(exc.status, exc.code, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _json(422, "invalid_request", _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _json(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(BatchinfError)
    async def _batchinf(_: Request, exc: BatchinfError) -> JSONResponse:
        if isinstance(exc, NotFoundError):
            return _json(404, "not_found", str(exc))
        if isinstance(exc, TransientError):
            return _json(503, "unavailable", f"{exc}; retry shortly")
        if isinstance(exc, (ManifestError, BundleError)):
            return _json(422, "invalid_manifest", str(exc))
        if isinstance(exc, LedgerError):
            return _json(409, "conflict", str(exc))
        return _json(400, "bad_request", str(exc))

    @app.exception_handler(DataError)
    async def _data(_: Request, exc: DataError) -> JSONResponse:
        return _json(422, "invalid_value", "a value cannot be stored (out of range, or a NUL or other "
                     f"control character): {str(exc.orig).splitlines()[0] if exc.orig else exc}")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _json(500, "internal", "internal error; the server log has the details")
