"""The web dashboard at /ui/: static files shipped in the package (batchinf/ui/), plain JS and SVG
over the /v1 API. The page itself is public; everything it shows comes from /v1 with the tenant's
bearer token (kept in the browser's sessionStorage after sign-in)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, Path
from fastapi.responses import RedirectResponse, Response

from batchinf.api.errors import ApiError

router = APIRouter(include_in_schema=False)

TYPES = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:",
           "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}


def _asset(name: str) -> Response:
    resource = files("batchinf").joinpath("ui", name)
    if not resource.is_file():
        raise ApiError(404, "not_found", f"no dashboard file {name!r}")
    return Response(resource.read_bytes(), media_type=TYPES[name.rsplit(".", 1)[1]], headers=HEADERS)


@router.get("/ui")
def ui_redirect() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/")
def ui_index() -> Response:
    return _asset("index.html")


@router.get("/ui/static/{name}")
def ui_static(name: str = Path(pattern=r"^[a-z]+\.(js|css)$")) -> Response:
    return _asset(name)
