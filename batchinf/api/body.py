"""Request bodies, bounded at one choke point: the ASGI middleware `BodyLimit` refuses a body over
its route's limit with 413 before more than the limit is read, whatever its framing: its
Content-Length is checked first, and the receive stream every route reads through (FastAPI's body
models, forms and uploads, `request.stream()`) counts the bytes as they arrive, so a chunked body
is cut off too. The connection is then closed, so a 400 MB body costs the server at most the limit
in memory, and no route can forget the bound."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Request

from batchinf.api.errors import ApiError, error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CLOSE = {"Connection": "close"}
MANIFEST_FIX = "a job manifest is a few hundred bytes"


class TooLarge(ApiError):
    """A body over its limit (413): raised by the bounded receive stream, answered by BodyLimit."""

    def __init__(self, limit: int, size: int | None = None, fix: str = MANIFEST_FIX) -> None:
        got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
        super().__init__(413, "too_large", f"the request body is {got}, over the limit of {limit} bytes; {fix}",
                         headers=CLOSE)


def too_large(limit: int, size: int | None = None, fix: str = MANIFEST_FIX) -> ApiError:
    return TooLarge(limit, size, fix)


def declared_length(headers: Any, limit: int, fix: str = MANIFEST_FIX) -> int | None:
    """The Content-Length header as an int (None when absent); ApiError when it is not a number
    or is over `limit`."""
    raw = headers.get("content-length")
    if raw is None:
        return None
    raw = raw.strip()
    if not raw.isdigit():
        raise ApiError(400, "bad_request", f"Content-Length {raw[:40]!r} is not a number of bytes", headers=CLOSE)
    if len(raw) > 18 or int(raw) > limit:     # (int() of thousands of digits would raise)
        raise too_large(limit, int(raw) if len(raw) <= 18 else None, fix)
    return int(raw)


async def read_limited(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes (within
    BodyLimit's bound, which every route has)."""
    declared_length(request.headers, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _answer(send: Send, exc: ApiError, path: str) -> None:
    payload = json.dumps(error_body(path, exc.status, exc.code, exc.message)).encode()
    await send({"type": "http.response.start", "status": exc.status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class BodyLimit:
    """ASGI middleware: every request body is bounded by its route's limit, `limit`, or for a path
    under one of `uploads` (file uploads, which spool to disk) that path's limit. A Content-Length
    over it (or not a number) is refused without reading the body; a body that grows past it as it
    arrives (chunked, or longer than declared) is cut off there: the app's receive raises TooLarge,
    whatever the app answers instead is dropped, and the client gets 413 and a closed connection."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int,
                 uploads: dict[str, tuple[int, str]] | None = None) -> None:
        self.app, self.limit, self.uploads = app, limit, uploads or {}

    def limit_of(self, path: str) -> tuple[int, str]:
        """(bytes, the fix to name) for a request to `path`."""
        return next((v for prefix, v in self.uploads.items() if path.startswith(prefix)), (self.limit, MANIFEST_FIX))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        limit, fix = self.limit_of(scope.get("path", ""))
        try:
            declared_length(headers, limit, fix)
        except ApiError as exc:
            await _answer(send, exc, scope.get("path", ""))
            return
        seen, over, started = 0, False, False

        async def bounded_receive() -> Message:
            nonlocal seen, over
            if over:                        # the app asks again after the refusal: nothing more is read
                raise TooLarge(limit, None, fix)
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    raise TooLarge(limit, None, fix)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over and not started:        # the app's own answer to the cut-off body (FastAPI: 400): ours instead
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, guarded_send)
        except Exception:
            if not over or started:
                raise
        if over and not started:
            await _answer(send, TooLarge(limit, None, fix), scope.get("path", ""))
