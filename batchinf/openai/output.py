"""OpenAI batch output: response lines rendered from the committed Parquet parts.

For a job whose input format is openai-batch, publishing writes `<output>/openai/part-NNNNN.jsonl`
beside the Parquet parts: one JSONL file per part (results or errors), its lines in the part's
row order, so the two can never disagree. A result line has OpenAI's response shape (status 200,
a chat.completion, text_completion or embedding list body with usage; an embeddings line's
vectors in its inputs' order, as floats or base64; for /v1/rerank the body Cohere, Jina and
vLLM return: `results` [{index, relevance_score}] best first, and usage); a failed line has status
400 when the line cannot be run as written and 500 when running it failed, with the error both
in the response body and in `error`. The bytes are deterministic: ids derive from the job id,
the custom_id and the line's place (source object, ordinal), `created` is the job's creation
time, so re-publishing (or verifying) gives identical files.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from batchinf.digests import sha256_file
from batchinf.parts import open_parquet
from batchinf.store import get_store

INPUT_ERROR_STATUS = 400     # the line itself cannot be run
SERVER_ERROR_CODES = {"inference_error": 500, "poison": 500}


@dataclass(frozen=True)
class RenderContext:
    """What every line of a job's rendering shares; stored in _MANIFEST.json so verify can re-render."""

    job_id: str
    created: int        # the job's creation time (UNIX seconds)
    model: str          # the bundle reference the job was submitted with
    task: str
    system_fingerprint: str | None = None   # fp_ + the bundle digest's first 12 hex digits

    def to_dict(self) -> dict[str, Any]:
        d = {"job_id": self.job_id, "created": self.created, "model": self.model, "task": self.task}
        if self.system_fingerprint is not None:
            d["system_fingerprint"] = self.system_fingerprint
        return d


def fingerprint(bundle_digest: str) -> str:
    """A chat/completions body's system_fingerprint: which exact model weights answered."""
    return "fp_" + bundle_digest.removeprefix("sha256:")[:12]


NOT_RUN_MESSAGES = {
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
    "batch_expired": "This request could not be executed before the completion window expired.",
}


def not_run_line(record_id: str | None, source: str, ordinal: int, code: str, ctx: RenderContext) -> dict[str, Any]:
    """A request that never ran because its batch was cancelled or expired (as OpenAI writes it)."""
    h = _hash(ctx, record_id, source, ordinal)
    return {"id": f"batch_req_{h[:32]}", "custom_id": record_id, "response": None,
            "error": {"code": code, "message": NOT_RUN_MESSAGES[code]}}


def _hash(ctx: RenderContext, custom_id: str | None, source: str, ordinal: int) -> str:
    """Per line: the job, the custom_id and the line's place (two lines may share a custom_id)."""
    return hashlib.sha256(f"{ctx.job_id}\0{custom_id}\0{source}\0{ordinal}".encode()).hexdigest()


Read = Callable[[str], bytes]     # an object's bytes by its URI


def read_object(uri: str) -> bytes:
    return get_store(uri).get_bytes(uri)


def result_line(row: dict[str, Any], ctx: RenderContext, read: Read = read_object) -> dict[str, Any]:
    """A succeeded line: status 200 and the body OpenAI returns for the job's task and the row's
    kind. `read` reads an image a line returns as base64 (publish reads the staged copy)."""
    h = _hash(ctx, row["record_id"], row["source"], row["ordinal"])
    if "image_uris" in row:         # /v1/images/generations
        return {"id": f"batch_req_{h[:32]}", "custom_id": row["record_id"], "response": {
            "status_code": 200, "request_id": f"req_{h[32:64]}", "body": image_body(row, ctx, read)}, "error": None}
    usage = {"prompt_tokens": row["input_tokens"]}
    if row.get("ranks") is not None:     # /v1/rerank: documents best first, the top ones if the line gave top_n
        order = row["top"] if row["top"] is not None else sorted(range(len(row["ranks"])), key=row["ranks"].__getitem__)
        body: dict[str, Any] = {"id": f"rerank-{h[:32]}", "model": ctx.model, "usage": {
            "total_tokens": row["input_tokens"]}, "results": [
            {"index": k, "relevance_score": row["scores"][k]} for k in order]}
    elif "embedding" in row:
        vectors = [row["embedding"]] if row["embedding"] is not None else row["embeddings"]
        body = {"object": "list", "model": ctx.model,
                "data": [{"object": "embedding", "index": k, "embedding": _encoded(v, row.get("encoding_format"))}
                         for k, v in enumerate(vectors)],
                "usage": {**usage, "total_tokens": row["input_tokens"]}}
    else:
        usage.update(completion_tokens=row["output_tokens"],
                     total_tokens=row["input_tokens"] + row["output_tokens"])
        if row["kind"] == "chat":
            lp = row.get("logprobs")
            choice = {"index": 0, "message": {"role": "assistant", "content": row["text"]},
                      "logprobs": {"content": json.loads(lp), "refusal": None} if lp else None,
                      "finish_reason": row["finish_reason"]}
            body = {"id": f"chatcmpl-{h[:32]}", "object": "chat.completion"}
        else:
            choice = {"index": 0, "text": row["text"], "logprobs": None, "finish_reason": row["finish_reason"]}
            body = {"id": f"cmpl-{h[:32]}", "object": "text_completion"}
        body.update(created=ctx.created, model=ctx.model, choices=[choice], usage=usage)
        if ctx.system_fingerprint is not None:
            body["system_fingerprint"] = ctx.system_fingerprint
    return {"id": f"batch_req_{h[:32]}", "custom_id": row["record_id"],
            "response": {"status_code": 200, "request_id": f"req_{h[32:64]}", "body": body}, "error": None}


def image_body(row: dict[str, Any], ctx: RenderContext, read: Read = read_object) -> dict[str, Any]:
    """An images response: `created` and one `data` item per image, its URI (response_format url;
    the output's images/ object) or its PNG as base64 (b64_json, the bytes `read` gives for that URI)."""
    if row.get("response_format") == "b64_json":
        data = [{"b64_json": base64.b64encode(read(u)).decode("ascii")} for u in row["image_uris"]]
    else:
        data = [{"url": u} for u in row["image_uris"]]
    return {"created": ctx.created, "data": data}


def _encoded(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """A vector as the request asked: a list of floats, or base64 of its little-endian float32
    bytes (what OpenAI sends for encoding_format "base64" and its SDK decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def error_line(row: dict[str, Any], ctx: RenderContext) -> dict[str, Any]:
    """A failed line: status 400 for a line that cannot be run as written, 500 for a failure while
    running it; the error is in the response body (as OpenAI writes it) and in `error`."""
    h = _hash(ctx, row["record_id"], row["source"], row["ordinal"])
    status = SERVER_ERROR_CODES.get(row["error"], INPUT_ERROR_STATUS)
    err = {"message": row["message"], "type": "invalid_request_error" if status == 400 else "server_error",
           "param": None, "code": row["error"]}
    return {"id": f"batch_req_{h[:32]}", "custom_id": row["record_id"],
            "response": {"status_code": status, "request_id": f"req_{h[32:64]}", "body": {"error": err}},
            "error": {"code": row["error"], "message": row["message"]}}


def _dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def render_to_path(part_uri: str, kind: str, ctx: RenderContext, path: str,
                   read: Read = read_object) -> tuple[str, int]:
    """Render one committed Parquet part (results or errors) as response lines into a local file;
    returns (sha256, lines). Streams row group by row group; `read` as for `result_line`."""
    lines = 0
    with open(path, "wb") as f, open_parquet(part_uri) as pf:
        for rb in pf.iter_batches(batch_size=1024):
            for row in rb.to_pylist():
                f.write(_dumps(result_line(row, ctx, read) if kind == "results" else error_line(row, ctx)))
                lines += 1
    return sha256_file(path), lines


def render_not_run(staged_uri: str, code: str, ctx: RenderContext, dest_uri: str) -> tuple[str, int]:
    """A not-done shard's requests (from its staged file) as `code` error lines, uploaded to dest_uri."""
    fd, tmp = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    lines = 0
    try:
        with open(tmp, "wb") as f, open_parquet(staged_uri) as pf:
            for rb in pf.iter_batches(batch_size=1024, columns=["record_id", "source", "ordinal"]):
                for row in rb.to_pylist():
                    f.write(_dumps(not_run_line(row["record_id"], row["source"], row["ordinal"], code, ctx)))
                    lines += 1
        digest = sha256_file(tmp)
        get_store(dest_uri).put_file(dest_uri, tmp)
        return digest, lines
    finally:
        os.unlink(tmp)
