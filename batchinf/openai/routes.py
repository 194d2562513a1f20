"""/v1/files and /v1/batches, OpenAI-compatible: handlers translate HTTP to `openai_batches`."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Path, Query, Request, UploadFile
from fastapi.responses import StreamingResponse

from batchinf.api.auth import Tenant
from batchinf.api.errors import ApiError
from batchinf.openai.schemas import (
    BatchCreate, BatchList, BatchObject, ErrorEnvelope, FileDeleted, FileList, FileObject,
)

router = APIRouter()

FileId = Annotated[str, Path(max_length=40, pattern=r"^file-[0-9a-f]+$")]
BatchId = Annotated[str, Path(max_length=40, pattern=r"^batch_[0-9a-f]+$")]
After = Annotated[str | None, Query(max_length=40, pattern=r"^[A-Za-z0-9_-]+$", description="id of the last item seen")]
Limit = Annotated[int, Query(ge=1, le=100)]
WHAT = {400: "invalid request (the message says why)", 401: "missing, invalid or revoked bearer token",
        404: "no such file or batch for this tenant (another tenant's looks exactly the same)",
        409: "the batch has already finished", 413: "the file is over BATCHINF_MAX_FILE_BYTES",
        422: "invalid parameter", 503: "the ledger is unavailable"}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ErrorEnvelope, "description": WHAT[c]} for c in codes}


@router.post("/v1/files", response_model=FileObject, tags=["openai"], responses=_errors(400, 401, 413, 422, 503))
def upload_file(request: Request, tenant: Tenant, file: Annotated[UploadFile, File()],
                purpose: Annotated[str, Form(max_length=32)]) -> Any:
    """Upload a batch input file (JSONL, one request per line); stored in the tenant's space."""
    from batchinf.config import settings
    from batchinf.openai.batches import upload_file as upload

    if int(request.headers.get("content-length") or 0) > settings().max_file_bytes + (1 << 16):
        raise ApiError(413, "too_large", f"the file is over {settings().max_file_bytes} bytes "
                                         "(BATCHINF_MAX_FILE_BYTES); split it")
    return upload(tenant, file.filename or "upload.jsonl", purpose, file.file)


@router.get("/v1/files", response_model=FileList, tags=["openai"], responses=_errors(401, 422, 503))
def list_files(tenant: Tenant, purpose: Annotated[str | None, Query(max_length=32, pattern=r"^[a-z_]+$")] = None,
               after: After = None, limit: Annotated[int, Query(ge=1, le=10000)] = 10000) -> Any:
    from batchinf.openai.batches import list_files as listing

    rows = listing(tenant, purpose=purpose, after=after, limit=limit + 1)
    data = rows[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


@router.get("/v1/files/{file_id}", response_model=FileObject, tags=["openai"], responses=_errors(401, 404, 422, 503))
def get_file(file_id: FileId, tenant: Tenant) -> Any:
    from batchinf.openai.batches import get_file as get

    return get(tenant, file_id)


@router.get("/v1/files/{file_id}/content", tags=["openai"], response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {"schema": {"type": "string"}}},
                             "description": "the file's bytes"}, **_errors(401, 404, 422, 503)})
def file_content(file_id: FileId, tenant: Tenant) -> StreamingResponse:
    from batchinf.openai.batches import file_content as content

    return StreamingResponse(content(tenant, file_id), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, tags=["openai"],
               responses=_errors(401, 404, 422, 503))
def delete_file(file_id: FileId, tenant: Tenant) -> Any:
    from batchinf.openai.batches import delete_file as delete

    return delete(tenant, file_id)


@router.post("/v1/batches", response_model=BatchObject, tags=["openai"], responses=_errors(400, 401, 404, 422, 503))
def create_batch(body: BatchCreate, tenant: Tenant) -> Any:
    """Create a batch from an uploaded file: a batchinf job underneath, visible in /v1/jobs."""
    from batchinf.openai.batches import create_batch as create

    return create(tenant, body.input_file_id, body.endpoint, body.completion_window, body.metadata)


@router.get("/v1/batches", response_model=BatchList, tags=["openai"], responses=_errors(401, 422, 503))
def list_batches(tenant: Tenant, after: After = None, limit: Limit = 20) -> Any:
    from batchinf.openai.batches import list_batches as listing

    return listing(tenant, after=after, limit=limit)


@router.get("/v1/batches/{batch_id}", response_model=BatchObject, tags=["openai"],
            responses=_errors(401, 404, 422, 503))
def get_batch(batch_id: BatchId, tenant: Tenant) -> Any:
    from batchinf.openai.batches import get_batch as get

    return get(tenant, batch_id)


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject, tags=["openai"],
             responses=_errors(401, 404, 409, 422, 503))
def cancel_batch(batch_id: BatchId, tenant: Tenant) -> Any:
    """Stop the batch: answers so far stay; requests not run get batch_cancelled error lines."""
    from batchinf.openai.batches import cancel_batch as cancel

    return cancel(tenant, batch_id)[0]
