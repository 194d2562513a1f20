"""OpenAI batch format: every kind of request line becomes a record or an error row saying why;
response lines have OpenAI's shape and deterministic bytes."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.digests import sha256_file
from batchinf.openai.lines import read_openai_batch
from batchinf.openai.output import RenderContext, error_line, render_to_path, result_line
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


def test_embeddings_take_lists_of_strings_and_token_arrays_with_dimensions_and_base64() -> None:
    a, b, c = read(line(EMBEDDINGS, {"input": ["one", "two"], "dimensions": 64, "encoding_format": "base64",
                                     "user": "u", "prompt_cache_key": "k", "safety_identifier": "s",
                                     "metadata": {"a": "b"}, "service_tier": "auto"}, "a"),
                   line(EMBEDDINGS, {"input": [101, 7, 102]}, "b"),
                   line(EMBEDDINGS, {"input": [[101, 102], [101, 5, 102]]}, "c"), task="embed")
    assert (a.error, a.text, a.items, a.params) == (None, None, ("one", "two"),
                                                    {"dimensions": 64, "encoding_format": "base64"})
    assert (b.error, b.items) == (None, ((101, 7, 102),))           # one token array
    assert (c.error, c.items) == (None, ((101, 102), (101, 5, 102)))


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
    (line(EMBEDDINGS, {"input": []}), "embed", "invalid_input", "empty list"),
    (line(EMBEDDINGS, {"input": ["a", ""]}), "embed", "invalid_input", "[1] is an empty string"),
    (line(EMBEDDINGS, {"input": ["a", [1, 2]]}), "embed", "invalid_input", "not a mix"),
    (line(EMBEDDINGS, {"input": [[1, 2], []]}), "embed", "invalid_input", "[1] is an empty list"),
    (line(EMBEDDINGS, {"input": [[1, -2]]}), "embed", "invalid_input", "holds -2, not a token id"),
    (line(EMBEDDINGS, {"input": [1, True]}), "embed", "invalid_input", "[0] is of type int"),
    (line(EMBEDDINGS, {"input": ["a"] * 2049}), "embed", "invalid_input", "at most 2048 per request"),
    (line(EMBEDDINGS, {"input": "x", "dimensions": 0}), "embed", "invalid_parameter", "body.dimensions must be"),
    (line(EMBEDDINGS, {"input": "x", "encoding_format": "int8"}), "embed", "invalid_parameter",
     "body.encoding_format must be"),
    (line(CHAT, {"messages": [{"role": "user", "content": "x"}], "dimensions": 8}), "generate",
     "unsupported_parameter", "body.dimensions is not supported for /v1/chat/completions"),
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
    several = {**row, "embedding": None, "embeddings": [[1.0, 0.0], [0.5, -2.0]], "encoding_format": "base64"}
    data = result_line(several, ctx)["response"]["body"]["data"]
    assert [d["index"] for d in data] == [0, 1]
    # base64 of little-endian float32, as OpenAI sends it
    assert [np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist() for d in data] == [[1.0, 0.0], [0.5, -2.0]]
    assert data[0]["embedding"] == "AACAPwAAAAA="


def test_dimensions_need_a_bundle_declaring_matryoshka_sizes() -> None:
    from batchinf.errors import BundleError
    from batchinf.tasks.embed_request import check_matryoshka_dims, dimensions_problem, shorten

    meta = {"task": "embed", "fixtures": [{"embedding": [0.0] * 8}]}
    assert dimensions_problem(8, meta, "b") is None                   # its own size is always fine
    assert "does not declare Matryoshka support" in dimensions_problem(4, meta, "b")
    assert "--matryoshka-dims" in dimensions_problem(4, meta, "b")
    meta["matryoshka_dims"] = check_matryoshka_dims([2, 4, 8], meta)
    assert meta["matryoshka_dims"] == [4, 2] and dimensions_problem(4, meta, "b") is None
    assert "use 8 or one of 4, 2" in dimensions_problem(3, meta, "b")
    for bad, task in (([9], "embed"), ([0], "embed"), ([4], "generate")):
        with pytest.raises(BundleError):
            check_matryoshka_dims(bad, {**meta, "task": task})
    from types import SimpleNamespace

    from batchinf.errors import ManifestError
    from batchinf.tasks.embed import Embed, EmbedOptions

    meta["max_length"] = 16
    assert Embed().limits(SimpleNamespace(meta=meta), EmbedOptions(dimensions=4)) == (16, True)
    with pytest.raises(ManifestError, match="options.dimensions 3 is not a size"):   # the job fails at planning
        Embed().limits(SimpleNamespace(meta=meta), EmbedOptions(dimensions=3))
    assert Embed().result_schema(meta, EmbedOptions(dimensions=4)).field("embedding").type.list_size == 4
    v = np.array([[3.0, 4.0, 12.0], [0.0, 0.0, 1.0]], np.float32)
    assert np.allclose(shorten(v, 2), [[0.6, 0.8], [0.0, 0.0]])      # cut, then unit length (zero stays zero)


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


def test_render_to_path_writes_one_parsable_line_per_row(tmp_path: Path) -> None:
    rows = [gen_row(f"q{i}", text=f"answer {i} ünï 🚀\nline two") for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows, schema=GENERATION_SCHEMA), tmp_path / "part.parquet")
    dest = str(tmp_path / "part-00000.jsonl")
    sha, n = render_to_path("file://" + str(tmp_path / "part.parquet"), "results", CTX, dest)
    out = tmp_path / "part-00000.jsonl"
    assert n == 5 and sha == sha256_file(out)
    lines = out.read_bytes().splitlines()
    assert len(lines) == 5
    parsed = [json.loads(x) for x in lines]
    assert [p["custom_id"] for p in parsed] == [f"q{i}" for i in range(5)]
    assert parsed[4]["response"]["body"]["choices"][0]["message"]["content"] == "answer 4 ünï 🚀\nline two"
    again, _ = render_to_path(str(tmp_path / "part.parquet"), "results", CTX, dest + ".2")   # a plain path too
    assert again == sha
    errs = [{"record_id": "e", "source": URI, "ordinal": 9, "error": "unsupported_n", "message": "m", "attempts": 1}]
    pq.write_table(pa.Table.from_pylist(errs, schema=ERROR_SCHEMA), tmp_path / "errors.parquet")
    _, n = render_to_path("file://" + str(tmp_path / "errors.parquet"), "errors", CTX, dest + ".e")
    assert n == 1


RERANK = "/v1/rerank"


def test_rerank_lines_become_score_records() -> None:
    ok = {"model": "ce@prod", "query": "which fox", "documents": ["a fox", {"text": "a dog"}], "top_n": 1}
    recs = read(line(RERANK, ok, "r1"), line(RERANK, {"query": "q", "documents": ["d"]}, "r2"),
                line(RERANK, {"query": "q", "documents": []}, "r3"), line(RERANK, {"documents": ["d"]}, "r4"),
                line(RERANK, {"query": "q", "documents": ["d"], "top_n": 0}, "r5"),
                line(RERANK, {"query": "q", "documents": ["d"], "return_documents": True}, "r6"),
                line(RERANK, {"query": "q", "documents": ["d"], "rank_fields": ["x"]}, "r7"), task="score")
    a, b, *bad = recs
    assert (a.error, a.endpoint, a.fields, a.params) == (None, RERANK, {"query": "which fox",
                                                                        "documents": ["a fox", "a dog"]}, {"top_n": 1})
    assert (b.error, b.params) == (None, {})
    assert [r.error for r in bad] == ["invalid_documents", "invalid_query", "invalid_parameter",
                                      "unsupported_return_documents", "unsupported_parameter"]
    (m,) = read(line(RERANK, ok), task="embed")
    assert m.error == "endpoint_mismatch" and "task: score" in m.message


def test_rerank_result_line_is_sorted_by_relevance() -> None:
    ctx = RenderContext(job_id="job-1", created=1, model="ce@prod", task="score")
    row = {"record_id": "r", "source": URI, "ordinal": 0, "score": None, "scores": [0.2, 0.9, 0.5],
           "ranks": [3, 1, 2], "top": None, "input_tokens": 30, "truncated": False}
    body = result_line(row, ctx)["response"]["body"]
    assert body["results"] == [{"index": 1, "relevance_score": 0.9}, {"index": 2, "relevance_score": 0.5},
                               {"index": 0, "relevance_score": 0.2}]
    assert body["model"] == "ce@prod" and body["usage"] == {"total_tokens": 30} and body["id"].startswith("rerank-")
    top = result_line({**row, "top": [1, 2]}, ctx)["response"]["body"]["results"]
    assert [r["index"] for r in top] == [1, 2]


def test_a_list_line_whose_input_fails_while_running_fails_whole() -> None:
    """Every input is its own sequence; one failing (isolated down to itself) fails its line
    alone, the other lines keep their vectors in input order, shortened where asked."""
    from types import SimpleNamespace

    from batchinf.tasks.embed import Embed, EmbedOptions

    def embed(batch: list[list[int]]) -> tuple[np.ndarray, int]:
        if any(13 in s for s in batch):
            raise RuntimeError("boom")
        return np.asarray([[float(s[0]), 1.0, 0.0, 0.0] for s in batch], np.float32), sum(map(len, batch))

    runtime = SimpleNamespace(meta={"fixtures": [{"embedding": [0.0] * 4}]}, embed=embed)
    c = {"record_id": ["one", "list", "bad", "short"], "source": [URI] * 4, "ordinal": [0, 1, 2, 3],
         "error": [None] * 4, "message": [None] * 4, "n_tokens": [1, 2, 2, 1], "truncated": [False] * 4,
         "input_ids": [[5], None, None, [3]], "items": [None, [[7], [2]], [[4], [13]], None],
         "dimensions": [None, None, None, 2], "encoding_format": [None, "base64", None, None]}
    out = Embed().run(c, runtime, EmbedOptions(), lambda: None)
    assert set(out.failures) == {2} and "boom" in out.failures[2]
    rows = {r["record_id"]: r for r in out.table.to_pylist()}
    assert rows["one"]["embedding"] == [5.0, 1.0, 0.0, 0.0] and rows["one"]["embeddings"] is None
    assert rows["list"]["embedding"] is None and [v[0] for v in rows["list"]["embeddings"]] == [7.0, 2.0]
    assert rows["list"]["encoding_format"] == "base64" and rows["list"]["input_tokens"] == 2
    assert np.allclose(rows["short"]["embeddings"], [[3 / 10 ** 0.5, 1 / 10 ** 0.5]])    # cut to 2, unit length
