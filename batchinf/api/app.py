"""The app factory: routes, JSON error handlers and request metrics."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response

from batchinf import metrics
from batchinf.api import errors, history, ui
from batchinf.api.body import BodyLimit
from batchinf.openai.routes import router as openai_router
from batchinf.api.routes import MAX_MANIFEST_BYTES, router
from batchinf.config import settings


def create_app() -> FastAPI:
    from importlib.metadata import version

    app = FastAPI(title="batchinf", version=version("batchinf"), separate_input_output_schemas=False,
                  description="Durable batch inference: submit jobs, watch their progress, read their "
                              "errors. Every /v1 request needs a bearer token, and sees only its "
                              "tenant's jobs.")
    errors.install(app)
    app.include_router(router)
    app.include_router(openai_router)
    app.include_router(history.router)
    app.include_router(ui.router)

    @app.middleware("http")
    async def _observe(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        t0 = time.perf_counter()
        status = 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            route = request.scope.get("route")
            metrics.observe_request(request.method, getattr(route, "path", "unmatched"), status,
                                    time.perf_counter() - t0)

    files = settings().max_file_bytes
    uploads = {"/v1/files": (files + (1 << 20),          # the file, plus its multipart framing
                             f"a file is at most {files} bytes (BATCHINF_MAX_FILE_BYTES); split it")}
    app.add_middleware(BodyLimit, limit=MAX_MANIFEST_BYTES, uploads=uploads)   # outermost: before any body is read
    return app
