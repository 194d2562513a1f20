"""The /v1 endpoints, /healthz and /metrics. Handlers only translate HTTP to library calls."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Path, Query, Request, Response

from batchinf import metrics
from batchinf.api.auth import Tenant, check_metrics_token
from batchinf.api.body import read_limited
from batchinf.api.errors import ApiError
from batchinf.api.schemas import (
    Bundle,
    ErrorBody,
    ErrorPage,
    Health,
    JobPage,
    JobView,
    ShardPage,
)
from batchinf.documents import MAX_DOCUMENT_BYTES, parse_document
from batchinf.errors import LedgerError
from batchinf.ledger.states import JobStatus
from batchinf.ledger.states import ShardStatus

router = APIRouter()

MAX_MANIFEST_BYTES = MAX_DOCUMENT_BYTES
JobId = Annotated[str, Path(pattern=r"^job-[0-9a-f]{16}$", description="as returned by POST /v1/jobs")]
Limit = Annotated[int, Query(ge=1, le=500, description="items per page")]
Cursor = Annotated[str | None, Query(max_length=200, pattern=r"^[A-Za-z0-9_-]+$",
                                     description="next_cursor of the previous page")]
Text = Annotated[str | None, Query(max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$")]


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    what = {400: "malformed request body (not JSON/YAML, YAML aliases, over-deep nesting, integers past 64 "
                 "bits), or a cursor this server did not issue",
            413: "the request body is over 1 MiB", 401: "missing, invalid or revoked bearer token",
            404: "no such job for this tenant (another tenant's job looks exactly the same)",
            409: "the job is in a state that does not allow this", 422: "invalid parameter or manifest",
            503: "the ledger is unavailable"}
    return {c: {"model": ErrorBody, "description": what[c]} for c in codes}


AUTHED = _errors(401, 422, 503)
PAGED = _errors(400, 401, 422, 503)


def _not_found(job_id: str) -> ApiError:
    # the same message whether the job is missing or belongs to another tenant
    return ApiError(404, "not_found", f"no job {job_id!r}")


def _load_job(job_id: str, tenant: str) -> dict[str, Any]:
    from batchinf.ledger.status import status

    try:
        return shown(status(job_id, tenant=tenant), tenant)
    except LedgerError:
        raise _not_found(job_id) from None


def shown(job: dict[str, Any], tenant: str) -> dict[str, Any]:
    """The job as its tenant sees it: no server path (scopes.shown)."""
    from batchinf.scopes import shown as shown_uri

    return {**job, "input_uri": shown_uri(job["input_uri"], tenant), "output_uri": shown_uri(job["output_uri"], tenant)}


def _page(request: Request, items: list[Any], next_cursor: str | None) -> dict[str, Any]:
    nxt = None
    if next_cursor:
        params = dict(request.query_params)
        params["cursor"] = next_cursor
        nxt = f"{request.url.path}?{urlencode(params)}"
    return {"items": items, "next_cursor": next_cursor, "next": nxt}


MANIFEST_BODY = {
    "required": True,
    "description": "A job manifest (manifests/job.schema.json) as JSON, or as YAML text.",
    "content": {
        "application/json": {"schema": {"type": "object", "additionalProperties": True}},
        "application/yaml": {"schema": {"type": "string"}},
    },
}


@router.post("/v1/jobs", status_code=201, response_model=JobView, tags=["jobs"],
             openapi_extra={"requestBody": MANIFEST_BODY},
             responses={200: {"model": JobView, "description": "the job with this idempotency key "
                              "already existed"}, 201: {"description": "job created"},
                        **_errors(400, 401, 413, 422, 503)})
async def submit_job(request: Request, response: Response, tenant: Tenant) -> Any:
    """Submit a job. The same `idempotency_key` (or, without one, the same manifest) returns the
    existing job with 200 instead of creating a second one."""
    from starlette.concurrency import run_in_threadpool

    raw = await read_limited(request, MAX_MANIFEST_BYTES)
    kind = "json" if "json" in request.headers.get("content-type", "") else "yaml"
    manifest = await run_in_threadpool(parse_document, raw, kind)    # never on the event loop
    job, created = await run_in_threadpool(_submit, manifest, tenant)
    response.status_code = 201 if created else 200
    return job


def _submit(raw: Any, tenant: str) -> tuple[dict[str, Any], bool]:
    from batchinf.ledger.status import status
    from batchinf.scopes import Caller
    from batchinf.submit import submit
    from batchinf.manifest import parse_manifest

    job_id, created = submit(parse_manifest(raw), Caller(tenant))      # a tenant's request: always confined
    return shown(status(job_id, tenant=tenant), tenant), created


@router.get("/v1/jobs", response_model=JobPage, tags=["jobs"], responses=PAGED)
def list_jobs(request: Request, tenant: Tenant, status: JobStatus | None = None, name: Text = None,
              schedule: Text = None, name_contains: Text = None, limit: Limit = 50,
              cursor: Cursor = None) -> Any:
    """This tenant's jobs, newest first, filtered by status, name (exact), name_contains (a
    case-insensitive substring) or schedule."""
    from batchinf.ledger.status import page_jobs

    items, nxt = page_jobs(limit, tenant=tenant, status_is=status.value if status else None, name=name,
                           schedule=schedule, name_contains=name_contains, cursor=cursor)
    return _page(request, [shown(j, tenant) for j in items], nxt)


@router.get("/v1/jobs/{job_id}", response_model=JobView, tags=["jobs"],
            responses={**AUTHED, **_errors(404)})
def get_job(job_id: JobId, tenant: Tenant) -> Any:
    """Status, progress, rates, ETA, counts, error summary, worker-seconds and cost of one job."""
    return _load_job(job_id, tenant)


@router.get("/v1/jobs/{job_id}/shards", response_model=ShardPage, tags=["jobs"],
            responses={**PAGED, **_errors(404)})
def job_shards(request: Request, job_id: JobId, tenant: Tenant, status: ShardStatus | None = None,
               limit: Limit = 100, cursor: Cursor = None) -> Any:
    from batchinf.ledger.status import page_shards

    try:
        items, nxt = page_shards(job_id, tenant=tenant, limit=limit, cursor=cursor,
                                 status_is=status.value if status else None)
    except LedgerError:
        raise _not_found(job_id) from None
    return _page(request, items, nxt)


@router.get("/v1/jobs/{job_id}/errors", response_model=ErrorPage, tags=["jobs"],
            responses={**PAGED, **_errors(404)})
def job_errors(request: Request, job_id: JobId, tenant: Tenant,
               code: Annotated[str | None, Query(max_length=64, pattern=r"^[a-z_]+$")] = None,
               limit: Limit = 100, cursor: Cursor = None) -> Any:
    """Record errors committed so far (the rows of errors/part-*.parquet), optionally of one code."""
    from batchinf.ledger.status import page_errors

    try:
        items, nxt = page_errors(job_id, tenant=tenant, limit=limit, cursor=cursor, code=code)
    except LedgerError:
        raise _not_found(job_id) from None
    return _page(request, items, nxt)


@router.post("/v1/jobs/{job_id}/cancel", response_model=JobView, tags=["jobs"],
             responses={**AUTHED, **_errors(404, 409)})
def cancel_job(job_id: JobId, tenant: Tenant) -> Any:
    """Stop the job: committed results stay and `_PARTIAL.json` describes them. 409 when the job
    has already finished."""
    from batchinf.controller import cancel

    _load_job(job_id, tenant)
    cancel(job_id, finish=False)     # the driver running the job finishes it
    return _load_job(job_id, tenant)


@router.get("/v1/bundles", response_model=list[Bundle], tags=["bundles"], responses=AUTHED)
def bundles(tenant: Tenant) -> Any:
    """Imported model bundles and their aliases (shared by every tenant)."""
    from batchinf.bundles import list_bundles

    return [{k: v for k, v in b.to_dict().items() if k != "uri"} for b in list_bundles()]   # no server paths


@router.get("/healthz", response_model=Health, tags=["service"], responses=_errors(503))
def healthz() -> Any:
    """Liveness and ledger reachability; needs no token."""
    from batchinf.ledger.db import ping

    try:
        ping()
    except Exception as exc:  # noqa: BLE001 -- any ledger failure is "unavailable"
        raise ApiError(503, "unavailable", f"ledger unreachable: {type(exc).__name__}") from None
    return {"status": "ok", "ledger": "ok"}


@router.get("/metrics", tags=["service"], dependencies=[Depends(check_metrics_token)],
            response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                             "description": "Prometheus text format"}, **_errors(401, 503)})
def prometheus() -> Response:
    """Prometheus metrics: this API process's, plus ledger-derived ones per job, bundle and tenant."""
    return Response(metrics.exposition(), media_type=metrics.CONTENT_TYPE_LATEST)
