"""Request and response models of the OpenAI-compatible /v1/files and /v1/batches (OpenAI's field
names and shapes, so the official `openai` client reads them)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str = Field(description="batch (uploaded) or batch_output (a batch's output or error file)")
    status: str = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class ErrorDetail(BaseModel):
    message: str = Field(description="what went wrong and how to fix it")
    type: str = Field(description="invalid_request_error, permission_error, rate_limit_error or server_error")
    param: str | None = Field(None, description="the request field at fault, where one is")
    code: str | None = Field(None, description="a stable code: not_found, bad_request, conflict, too_large, ...")
    line: int | None = Field(None, description="the line of the uploaded file at fault, where one is")


class ErrorEnvelope(BaseModel):
    """OpenAI's error document: what the official SDK reads into its exceptions."""
    error: ErrorDetail


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str = Field(max_length=40, pattern=r"^file-[0-9a-f]+$")
    endpoint: str = Field(max_length=64, description="/v1/chat/completions, /v1/completions, /v1/embeddings or /v1/rerank")
    completion_window: str = Field("24h", max_length=16, pattern=r"^\d+(\.\d+)?[smhd]?$",
                                   description="the job's deadline; 24h as OpenAI's")
    metadata: dict[str, str] | None = None


class BatchError(BaseModel):
    code: str | None
    message: str | None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens_details: dict[str, int]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, Any] | None
    usage: BatchUsage | None
    job_id: str | None = Field(None, description="the batchinf job underneath (GET /v1/jobs/{id})")


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
