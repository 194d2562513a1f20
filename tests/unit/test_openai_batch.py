"""OpenAI batch format: every kind of request line becomes a record or an error row saying why;
response lines have OpenAI's shape and deterministic bytes."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.digests import sha256_file
from batchinf.formats.openai_batch import read_openai_batch
from batchinf.openai_output import RenderContext, error_line, render_part, result_line
from batchinf.parts import ERROR_SCHEMA, GENERATION_SCHEMA

URI = "file:///data/batch.jsonl"
CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"


def line(url: str = CHAT, body: Any = None, custom_id: Any = "c1", method: str = "POST") -> str:
    if body is None:
        body = {"messages": [{"role": "user", "content": "hi"}]} if url == CHAT else \
            {"prompt": "Once upon"} if url == COMPLETIONS else {"input": "embed me"}
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def read(*lines: str, task: str = "generate") -> list:
    return list(read_openai_batch(io.BytesIO("\n".join(lines).encode() + b"\n"), URI, task))


def test_supported_lines_become_records_with_their_overrides() -> None:
    chat = {"model": "gpt-4o-mini", "user": "u1", "n": 1, "stream": False, "logprobs": False,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
            "max_completion_tokens": 40, "temperature": 0.7, "top_p": 0.9, "seed": 11, "stop": "\n\n"}
    recs = read(line(CHAT, chat, "a"), line(COMPLETIONS, {"prompt": "Once upon", "max_tokens": 5, "top_k": 3,
                                                          "stop": ["END", "."]}, "b"), line(CHAT, custom_id=7))
    a, b, c = recs
    assert (a.record_id, a.error, a.endpoint, a.text) == ("a", None, CHAT, None)
    assert a.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    assert a.params == {"max_tokens": 40, "temperature": 0.7, "top_p": 0.9, "seed": 11, "stop": ["\n\n"],
                        "logprobs": False}
    assert (b.record_id, b.text, b.endpoint, b.messages) == ("b", "Once upon", COMPLETIONS, None)
    assert b.params == {"max_tokens": 5, "top_k": 3, "stop": ["END", "."]}
    assert (c.record_id, c.params, c.error) == ("7", {}, None)
    assert [r.ordinal for r in recs] == [0, 1, 2]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                 "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    (d,) = read(line(CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": rf, "logprobs": True,
                            "top_logprobs": 3}, "d"))
    assert (d.error, d.params) == (None, {"response_format": rf, "logprobs": True, "top_logprobs": 3})
    (e,) = read(line(EMBEDDINGS, {"input": "vector please", "model": "x", "encoding_format": "float"}), task="embed")
    assert (e.text, e.endpoint, e.error, e.params) == ("vector please", EMBEDDINGS, None, {})


BAD = [
    # (line, task, code, fragment of the message)
    ("{oops", "generate", "malformed_json", "malformed JSON"),
    ("[1, 2]", "generate", "malformed_json", "expected a JSON object"),
    (json.dumps({"method": "POST", "url": CHAT, "body": {}}), "generate", "missing_id", "custom_id is missing"),
    (line(custom_id={"a": 1}), "generate", "missing_id", "custom_id is not a string"),
    (line(method="GET"), "generate", "unsupported_method", "method 'GET' is not supported"),
    (line("/v1/responses", {"input": "x"}), "generate", "unsupported_endpoint", "use /v1/chat/completions"),
    (line(EMBEDDINGS), "generate", "endpoint_mismatch", "needs a job with task: embed"),
    (line(CHAT), "embed", "endpoint_mismatch", "needs a job with task: generate"),
    (json.dumps({"custom_id": "c1", "method": "POST", "url": CHAT, "body": "hi"}), "generate", "invalid_body",
     "body must be a JSON object, got str"),
    (json.dumps({"custom_id": "c1", "method": "POST", "url": CHAT}), "generate", "invalid_body", "got null"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 3}), "generate", "unsupported_n",
     "repeat the line with another custom_id"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True}), "generate",
     "unsupported_stream", "stream is not available in a batch"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}), "generate",
     "unsupported_tools", "function calling"),
    (line(COMPLETIONS, {"prompt": "x", "logprobs": 2}), "generate",
     "unsupported_logprobs", "chat/completions lines only"),
    (line(COMPLETIONS, {"prompt": "x", "response_format": {"type": "json_object"}}),
     "generate", "unsupported_response_format", "chat/completions lines only"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}),
     "generate", "invalid_parameter", "body.response_format must be an object with type one of"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}),
     "generate", "invalid_parameter", "json_schema.name must be"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}}}),
     "generate", "invalid_parameter", "json_schema.schema must be a JSON Schema object"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), "generate",
     "invalid_parameter", "needs body.logprobs: true"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}),
     "generate", "invalid_parameter", "body.top_logprobs must be an integer in [0, 20]"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}), "generate",
     "invalid_parameter", "body.logprobs must be true or false"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5}), "generate",
     "unsupported_frequency_penalty", "remove it or set 0"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "wibble": 1}), "generate",
     "unsupported_parameter", "body.wibble is not supported"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "temperature": 3}), "generate",
     "invalid_parameter", "body.temperature must be a number in [0, 2]"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), "generate",
     "invalid_parameter", "body.max_tokens must be an integer"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "seed": -1}), "generate",
     "invalid_parameter", "body.seed must be an integer"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "stop": [""]}), "generate",
     "invalid_parameter", "body.stop must be"),
    (line(CHAT, {"messages": []}), "generate", "invalid_messages", "non-empty list"),
    (line(CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "generate",
     "invalid_messages", "only text parts"),
    (line(CHAT, {"prompt": "x"}), "generate", "unsupported_parameter", "body.prompt is not supported"),
    (line(COMPLETIONS, {"prompt": ["a", "b"]}), "generate", "unsupported_prompt",
     "put each on its own line with its own custom_id"),
    (line(COMPLETIONS, {"prompt": ""}), "generate", "invalid_prompt", "body.prompt is empty"),
    (line(COMPLETIONS, {"prompt": 5}), "generate", "invalid_prompt", "body.prompt is of type int"),
    (line(COMPLETIONS, {}), "generate", "invalid_prompt", "body.prompt is missing"),
    (line(COMPLETIONS, {"prompt": "x", "echo": True}), "generate", "unsupported_echo", "echo is not supported"),
    (line(EMBEDDINGS, {"input": ["a", "b"]}), "embed", "unsupported_input", "one string per line"),
    (line(EMBEDDINGS, {"input": "x", "dimensions": 64}), "embed", "unsupported_dimensions", "fixed"),
    (line(EMBEDDINGS, {"input": "x", "encoding_format": "base64"}), "embed", "unsupported_encoding_format",
     "float"),
    (line(EMBEDDINGS, {"input": "x", "max_tokens": 3}), "embed", "unsupported_parameter", "body.max_tokens"),
]


@pytest.mark.parametrize("raw, task, code, fragment", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_unsupported_or_malformed_lines_are_error_rows_saying_why(raw: str, task: str, code: str,
                                                                   fragment: str) -> None:
    good = line(CHAT if task == "generate" else EMBEDDINGS, custom_id="ok")
    recs = read(good, raw, good.replace('"ok"', '"ok2"'), task=task)
    assert [r.ordinal for r in recs] == [0, 1, 2]
    assert recs[0].error is None and recs[2].error is None          # the neighbours are unaffected
    bad = recs[1]
    assert bad.error == code and fragment in bad.message, bad.message
    assert bad.message.startswith(f"{URI} line 2")
    if code != "missing_id" and code != "malformed_json":
        assert bad.record_id == "c1" and "custom_id 'c1'" in bad.message   # the line is named


# --- output ------------------------------------------------------------------------------------------

CTX = RenderContext(job_id="job-1", created=1_790_000_000, model="smol@prod", task="generate")


def gen_row(record_id: str, kind: str = "chat", **kw: Any) -> dict[str, Any]:
    row = {"record_id": record_id, "source": URI, "ordinal": 3, "kind": kind, "text": "Paris.",
           "finish_reason": "stop", "input_tokens": 12, "output_tokens": 3, "seed": 5, "output_ids": [1, 2, 3]}
    return {**row, **kw}


def test_chat_and_completion_result_lines() -> None:
    chat = result_line(gen_row("q1"), CTX)
    assert chat["custom_id"] == "q1" and chat["error"] is None
    assert chat["id"].startswith("batch_req_") and chat["response"]["request_id"].startswith("req_")
    body = chat["response"]["body"]
    assert chat["response"]["status_code"] == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert (body["created"], body["model"]) == (CTX.created, "smol@prod")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    comp = result_line(gen_row("q2", kind="completion", finish_reason="length"), CTX)["response"]["body"]
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"] == "Paris."
    assert comp["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs_in_openai_shape() -> None:
    content = [{"token": "Paris", "logprob": -0.25, "bytes": list(b"Paris"),
                "top_logprobs": [{"token": "Paris", "logprob": -0.25, "bytes": list(b"Paris")}]}]
    body = result_line(gen_row("q1", logprobs=json.dumps(content)), CTX)["response"]["body"]
    assert body["choices"][0]["logprobs"] == {"content": content, "refusal": None}
    assert result_line(gen_row("q1", logprobs=None), CTX)["response"]["body"]["choices"][0]["logprobs"] is None


def test_embedding_result_line() -> None:
    ctx = RenderContext(job_id="job-1", created=1, model="tiny@prod", task="embed")
    row = {"record_id": "e1", "source": URI, "ordinal": 0, "embedding": [0.25, -0.5], "input_tokens": 4,
           "output_tokens": 0, "truncated": False}
    body = result_line(row, ctx)["response"]["body"]
    assert body["object"] == "list" and body["data"] == [{"object": "embedding", "index": 0,
                                                          "embedding": [0.25, -0.5]}]
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}


@pytest.mark.parametrize("code, status", [("unsupported_n", 400), ("prompt_too_long", 400),
                                          ("inference_error", 500), ("poison", 500)])
def test_error_lines(code: str, status: int) -> None:
    row = {"record_id": "x", "source": URI, "ordinal": 1, "error": code, "message": "why and what to do",
           "attempts": 1}
    got = error_line(row, CTX)
    assert got["response"]["status_code"] == status
    assert got["response"]["body"]["error"]["code"] == code
    assert got["response"]["body"]["error"]["message"] == "why and what to do"
    assert got["error"] == {"code": code, "message": "why and what to do"}


def test_ids_are_deterministic_and_distinct() -> None:
    a, b = result_line(gen_row("q1"), CTX), result_line(gen_row("q1"), CTX)
    assert a == b
    other = result_line(gen_row("q2"), CTX)
    assert other["id"] != a["id"] and other["response"]["request_id"] != a["response"]["request_id"]
    other_job = result_line(gen_row("q1"), RenderContext("job-2", CTX.created, CTX.model, CTX.task))
    assert other_job["id"] != a["id"]
    # lines without a custom_id (malformed JSON) still get distinct ids, from source and ordinal
    e = {"record_id": None, "source": URI, "error": "malformed_json", "message": "m", "attempts": 1}
    assert error_line({**e, "ordinal": 1}, CTX)["id"] != error_line({**e, "ordinal": 2}, CTX)["id"]


def test_render_part_writes_one_parsable_line_per_row(tmp_path: Path) -> None:
    rows = [gen_row(f"q{i}", text=f"answer {i} ünï 🚀\nline two") for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA), tmp_path / "part.parquet")
    dest = "file://" + str(tmp_path / "openai" / "part-00000.jsonl")
    sha, n = render_part("file://" + str(tmp_path / "part.parquet"), "results", CTX, dest)
    out = tmp_path / "openai" / "part-00000.jsonl"
    assert n == 5 and sha == sha256_file(out)
    lines = out.read_bytes().splitlines()
    assert len(lines) == 5
    parsed = [json.loads(x) for x in lines]
    assert [p["custom_id"] for p in parsed] == [f"q{i}" for i in range(5)]
    assert parsed[4]["response"]["body"]["choices"][0]["message"]["content"] == "answer 4 ünï 🚀\nline two"
    again, _ = render_part("file://" + str(tmp_path / "part.parquet"), "results", CTX, dest + ".2")
    assert again == sha
    errs = [{"record_id": "e", "source": URI, "ordinal": 9, "error": "unsupported_n", "message": "m", "attempts": 1}]
    pq.write_table(pa.Table.from_pylist(errs, schema=ERROR_SCHEMA), tmp_path / "errors.parquet")
    _, n = render_part("file://" + str(tmp_path / "errors.parquet"), "errors", CTX, dest + ".e")
    assert n == 1
