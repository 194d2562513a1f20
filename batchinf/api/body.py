"""Request bodies, bounded: a body over the limit is refused with 413 before more than the limit
is read (its Content-Length is checked first, then the bytes as they arrive), and its connection
is closed, so a 400 MB upload costs the server at most the limit in memory."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Request

from batchinf.api.errors import ApiError, body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CLOSE = {"Connection": "close"}


def too_large(limit: int, size: int | None = None) -> ApiError:
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return ApiError(413, "too_large", f"the request body is {got}, over the limit of {limit} bytes; "
                    "a job manifest is a few hundred bytes", headers=CLOSE)


def declared_length(headers: Any, limit: int) -> int | None:
    """The Content-Length header as an int (None when absent); ApiError when it is not a number
    or is over `limit`."""
    raw = headers.get("content-length")
    if raw is None:
        return None
    raw = raw.strip()
    if not raw.isdigit():
        raise ApiError(400, "bad_request", f"Content-Length {raw[:40]!r} is not a number of bytes", headers=CLOSE)
    if len(raw) > 18 or int(raw) > limit:     # (int() of thousands of digits would raise)
        raise too_large(limit, int(raw) if len(raw) <= 18 else None)
    return int(raw)


async def read_limited(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    declared_length(request.headers, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class BodyLimit:
    """ASGI middleware: any request whose Content-Length is over its route's limit gets 413 (or
    400 for a Content-Length that is not a number) without its body being read, on every route:
    `limit`, or for a path under one of `uploads` (file uploads, which stream with a limit of
    their own) that path's limit."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int,
                 uploads: dict[str, int] | None = None) -> None:
        self.app, self.limit, self.uploads = app, limit, uploads or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
            path = scope.get("path", "")
            limit = next((n for prefix, n in self.uploads.items() if path.startswith(prefix)), self.limit)
            try:
                declared_length(headers, limit)
            except ApiError as exc:
                payload = json.dumps(body(exc.code, exc.message)).encode()
                await send({"type": "http.response.start", "status": exc.status,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"content-length", str(len(payload)).encode())]})
                await send({"type": "http.response.body", "body": payload})
                return
        await self.app(scope, receive, send)
