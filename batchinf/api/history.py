"""A job's history: its attempts (the dashboard's shard timeline), its throughput over
time, and `POST /v1/jobs/{id}/retry`. Tenant-scoped like every /v1 endpoint."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from batchinf.api.auth import Tenant
from batchinf.api.routes import AUTHED, PAGED, Cursor, JobId, _errors, _load_job, _not_found, _page
from batchinf.api.schemas import AttemptPage, JobView, RetryRequest, Throughput
from batchinf.errors import LedgerError

router = APIRouter()


@router.get("/v1/jobs/{job_id}/attempts", response_model=AttemptPage, tags=["jobs"],
            responses={**PAGED, **_errors(404)})
def job_attempts(request: Request, job_id: JobId, tenant: Tenant,
                 limit: Annotated[int, Query(ge=1, le=1000, description="items per page")] = 500,
                 cursor: Cursor = None) -> Any:
    """Every attempt of every shard in start order: worker, times, status and the outcome the
    shard timeline colours it by (committed, retried, lost, quarantined, superseded, ...)."""
    from batchinf.ledger.history import page_attempts

    try:
        items, nxt = page_attempts(job_id, tenant=tenant, limit=limit, cursor=cursor)
    except LedgerError:
        raise _not_found(job_id) from None
    return _page(request, items, nxt)


@router.get("/v1/jobs/{job_id}/throughput", response_model=Throughput, tags=["jobs"],
            responses={**AUTHED, **_errors(404)})
def job_throughput(job_id: JobId, tenant: Tenant,
                   points: Annotated[int, Query(ge=1, le=500, description="intervals")] = 60) -> Any:
    """Records and tokens committed per interval (from the committing attempts' finish times)."""
    from batchinf.ledger.history import throughput

    try:
        return throughput(job_id, tenant=tenant, points=points)
    except LedgerError:
        raise _not_found(job_id) from None


@router.post("/v1/jobs/{job_id}/retry", status_code=201, response_model=JobView, tags=["jobs"],
             responses={**AUTHED, **_errors(400, 404, 409)})
def retry_job(job_id: JobId, body: RetryRequest, tenant: Tenant) -> Any:
    """A new job over exactly the records with these error codes and/or the records that never
    finished, with the same pinned bundle and inputs and a new output; 409 while the job is active."""
    from batchinf.ledger.jobs import get as get_job
    from batchinf.rerun import rerun_job
    from batchinf.scopes import Caller

    _load_job(job_id, tenant)
    rerun = rerun_job(get_job(job_id, tenant=tenant), Caller(tenant), errors=body.errors, not_done=body.not_done,
                      output=body.output)
    return _load_job(rerun.job_id, tenant)
