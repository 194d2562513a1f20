"""OpenAI batch input files: request lines in, records out (the `openai-batch` input format).

One request per line, `{"custom_id", "method": "POST", "url", "body"}` for
`/v1/chat/completions` (body.messages), `/v1/completions` (body.prompt, one string) and
`/v1/embeddings` (body.input: a string, a list of strings, a list of token ids, or a list of
token-id lists; at most MAX_EMBED_INPUTS of them, `dimensions` and `encoding_format` honoured by
task embed at staging and rendering) and `/v1/rerank` (body.query, body.documents, optional
body.top_n: the shape Cohere, Jina and vLLM share). The custom_id is the record id; a line's url
must suit the job's task (chat and completions: generate; embeddings: embed; rerank: score).
Sampling fields of the body (max_tokens / max_completion_tokens, temperature, top_p, top_k, seed,
stop) and, for chat lines, response_format (json_object, json_schema), logprobs and top_logprobs
override the job's options for that line and are checked like the manifest's options
(batchinf.checks); a schema that cannot be enforced is found when the job is planned, and is that
line's error row. Body keys
that do not change the answer (IGNORED) are accepted and ignored; anything batchinf cannot honour
(_NOT_SUPPORTED, unknown keys) becomes the line's error row, saying why and what to do -- never
a silently different answer. The response lines are rendered by batchinf.openai.output.
"""

from __future__ import annotations

from typing import Any, BinaryIO, Iterator

from batchinf.checks import (MAX_TOP_LOGPROBS, integer_problem, number_problem, response_format_problem,
                             stop_strings)
from batchinf.formats.jsonl import parse_problem, json_objects
from batchinf.formats.record import InputRecord, check_messages, record_id_of, unicode_problem

CHAT, COMPLETIONS, EMBEDDINGS, RERANK = "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank"
IMAGES = "/v1/images/generations"
ENDPOINT_TASK = {CHAT: "generate", COMPLETIONS: "generate", EMBEDDINGS: "embed", RERANK: "score",
                 IMAGES: "generate_image"}
IMAGE_FORMATS = ("url", "b64_json")
MAX_IMAGES_PER_LINE = 1 << 10   # body.n; the job's options.max_images bounds it further at staging

# Body keys that do not change the answer: accepted and ignored.
IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls",
           "prompt_cache_key", "safety_identifier", "prompt_cache_retention"}
# Body keys with a value batchinf honours only at its default: (is-default test, why and what to do).
_NOT_SUPPORTED: dict[str, tuple[Any, str]] = {
    "n": (lambda v: v in (None, 1), ("n > 1 is not supported (one answer per line); repeat the line with "
                                     "another custom_id and seed for more answers")),
    "stream": (lambda v: v in (None, False), "stream is not available in a batch; remove it"),
    "tools": (lambda v: not v, "tools (function calling) are not supported; remove tools and tool_choice"),
    "tool_choice": (lambda v: v in (None, "none"), "tool_choice is not supported; remove it"),
    "functions": (lambda v: not v, "functions (function calling) are not supported; remove them"),
    "function_call": (lambda v: v in (None, "none"), "function_call is not supported; remove it"),
    "logprobs": (lambda v: v in (None, False), "logprobs are returned for /v1/chat/completions lines only"),
    "top_logprobs": (lambda v: v in (None, 0), "top_logprobs are returned for /v1/chat/completions lines only"),
    "echo": (lambda v: v in (None, False), "echo is not supported; remove it"),
    "best_of": (lambda v: v in (None, 1), "best_of > 1 is not supported; remove it"),
    "suffix": (lambda v: v in (None, ""), "suffix (fill-in-the-middle) is not supported; remove it"),
    "logit_bias": (lambda v: not v, "logit_bias is not supported; remove it"),
    "frequency_penalty": (lambda v: v in (None, 0), "frequency_penalty is not supported; remove it or set 0"),
    "presence_penalty": (lambda v: v in (None, 0), "presence_penalty is not supported; remove it or set 0"),
    "response_format": (lambda v: v in (None, {"type": "text"}),
                        "response_format (JSON mode, schemas) is supported for /v1/chat/completions lines only"),
    "modalities": (lambda v: v in (None, ["text"]), "only text output is supported; remove modalities"),
    "audio": (lambda v: v is None, "audio output is not supported; remove audio"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported; remove prediction"),
}
_CONTENT = {CHAT: "messages", COMPLETIONS: "prompt", EMBEDDINGS: "input"}
_SAMPLING = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
_EMBEDDING = {"dimensions", "encoding_format"}
MAX_EMBED_INPUTS = 2048         # inputs in one embeddings request, as OpenAI allows
MAX_TOKEN_ID = (1 << 31) - 1    # staged as int32; the bundle's vocabulary is checked at staging
_CHAT_ONLY = {"response_format", "logprobs", "top_logprobs"}     # honoured on chat lines


def read_openai_batch(fh: BinaryIO, uri: str, task: str) -> Iterator[InputRecord]:
    """Records of one OpenAI batch input file; a line batchinf cannot run is its error row."""
    for ordinal, where, obj in json_objects(fh, uri):
        if isinstance(obj, InputRecord):
            yield obj
            continue
        try:
            yield parse_line(obj, ordinal, where, task)
        except Exception as exc:  # noqa: BLE001 -- a line that breaks the checks fails that line only
            yield _error(ordinal, None, "malformed_json", f"{where}: malformed request line ({parse_problem(exc)})")


def _error(ordinal: int, rid: str | None, code: str, message: str) -> InputRecord:
    return InputRecord(ordinal, rid, None, code, message)


def parse_line(obj: dict[str, Any], ordinal: int, where: str, task: str) -> InputRecord:
    """One request line (a JSON object) as a record, or its error row; `where` names the line."""
    rid = record_id_of(obj.get("custom_id"))
    if rid is None:
        raw = obj.get("custom_id")
        what = "missing" if raw is None else f"not a string ({raw!r:.40})"
        return _error(ordinal, None, "missing_id", f"{where}: custom_id is {what}; every line needs a "
                                                   "unique custom_id string")
    here = f"{where} (custom_id {rid!r})"
    url, method, body = obj.get("url"), obj.get("method"), obj.get("body")
    if method != "POST":
        return _error(ordinal, rid, "unsupported_method", f"{here}: method {method!r} is not supported; "
                                                          "batch lines are POST requests")
    if url not in ENDPOINT_TASK:
        return _error(ordinal, rid, "unsupported_endpoint",
                      f"{here}: url {url!r} is not supported; use {CHAT}, {COMPLETIONS}, {EMBEDDINGS}, {RERANK} "
                      f"or {IMAGES}")
    if ENDPOINT_TASK[url] != task:
        return _error(ordinal, rid, "endpoint_mismatch",
                      f"{here}: url {url} needs a job with task: {ENDPOINT_TASK[url]}, this job's task is "
                      f"{task}; put {url} lines in their own file and job")
    if not isinstance(body, dict):
        return _error(ordinal, rid, "invalid_body", f"{here}: body must be a JSON object, got "
                                                    f"{type(body).__name__ if body is not None else 'null'}")
    if url == RERANK:
        return _rerank(body, ordinal, rid, here)
    if url == IMAGES:
        return _images(body, ordinal, rid, here)
    known = IGNORED | set(_NOT_SUPPORTED) | {_CONTENT[url]} | (_SAMPLING if url != EMBEDDINGS else _EMBEDDING)
    for key, value in body.items():
        if key not in known:
            return _error(ordinal, rid, "unsupported_parameter",
                          f"{here}: body.{key} is not supported for {url}; remove it")
        if key in _NOT_SUPPORTED and not _NOT_SUPPORTED[key][0](value) and not (url == CHAT and key in _CHAT_ONLY):
            return _error(ordinal, rid, f"unsupported_{key}", f"{here}: body.{key}={value!r:.60}: "
                                                              f"{_NOT_SUPPORTED[key][1]}")
    params, problem = _sampling(body) if url != EMBEDDINGS else _embedding(body)
    if not problem and url == CHAT:
        problem = _structured(body, params)
    if problem:
        return _error(ordinal, rid, "invalid_parameter", f"{here}: {problem}")
    field = _CONTENT[url]
    value = body.get(field)
    if url == CHAT:
        messages, problem = check_messages(value)
        if problem:
            return _error(ordinal, rid, "invalid_messages", f"{here}: body.messages {problem}")
        return InputRecord(ordinal, rid, None, messages=messages, params=params, endpoint=url)
    if isinstance(value, list) and url == EMBEDDINGS:
        items, problem = embedding_inputs(value)
        if problem:
            return _error(ordinal, rid, "invalid_input", f"{here}: body.input {problem}")
        return InputRecord(ordinal, rid, None, params=params, endpoint=url, items=items)
    if isinstance(value, list):
        return _error(ordinal, rid, f"unsupported_{field}",
                      f"{here}: body.{field} is a list; batchinf takes one string per line -- put each "
                      "on its own line with its own custom_id")
    if not isinstance(value, str) or not value.strip():
        what = ("missing" if value is None else "empty" if isinstance(value, str)
                else f"of type {type(value).__name__}")
        return _error(ordinal, rid, f"invalid_{field}", f"{here}: body.{field} is {what}; it must be a "
                                                        "non-empty string")
    bad = unicode_problem(value)
    if bad:
        return _error(ordinal, rid, "invalid_utf8", f"{here}: body.{field} is not valid Unicode ({bad})")
    return InputRecord(ordinal, rid, value, params=params, endpoint=url)


def embedding_inputs(value: list[Any]) -> tuple[tuple[Any, ...], str | None]:
    """A list `input` of an embeddings line -> (its inputs: strings or token-id tuples, None), or
    ((), what is wrong). A flat list of integers is one token array, as OpenAI reads it."""
    if not value:
        return (), "is an empty list; give at least one input"
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        value = [value]
    if len(value) > MAX_EMBED_INPUTS:
        return (), (f"has {len(value)} inputs; at most {MAX_EMBED_INPUTS} per request -- split it over "
                    "several lines")
    strings = all(isinstance(x, str) for x in value)
    items: list[Any] = []
    for k, x in enumerate(value):
        if strings:
            if not x.strip():
                return (), f"[{k}] is an empty string; every input must be non-empty"
            if (bad := unicode_problem(x)):
                return (), f"[{k}] is not valid Unicode ({bad})"
            items.append(x)
            continue
        if not isinstance(x, list) or not x:
            return (), (f"[{k}] is {_what(x)}; a list input holds strings, or token arrays (non-empty lists "
                        "of integers), not a mix")
        if (bad := next((t for t in x if integer_problem(t, "", 0, MAX_TOKEN_ID)), None)) is not None:
            return (), f"[{k}] holds {bad!r:.40}, not a token id (an integer in [0, {MAX_TOKEN_ID}])"
        items.append(tuple(x))
    return tuple(items), None


def _what(x: Any) -> str:
    return "an empty list" if x == [] else "null" if x is None else f"of type {type(x).__name__}"


def _embedding(body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """An embeddings line's `dimensions` and `encoding_format` (float or base64): (params, None),
    or ({}, what is wrong). Whether the bundle can give `dimensions` is checked at staging."""
    p: dict[str, Any] = {}
    if body.get("dimensions") is not None:
        if (err := integer_problem(body["dimensions"], "body.dimensions", 1, 1 << 16)):
            return {}, err
        p["dimensions"] = body["dimensions"]
    fmt = body.get("encoding_format")
    if fmt not in (None, "float", "base64"):
        return {}, f"body.encoding_format must be \"float\" or \"base64\", got {fmt!r:.40}"
    if fmt == "base64":
        p["encoding_format"] = fmt
    return p, None


def _sampling(body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Per-line overrides of the job's generate options, checked like the manifest's:
    (overrides, None), or (what was read so far, what is wrong)."""
    p: dict[str, Any] = {}
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None:
            if (err := integer_problem(body[key], f"body.{key}", 1, 1 << 31)):
                return p, err
            p["max_tokens"] = body[key]
    for key, lo, hi, lo_open in (("temperature", 0, 2, False), ("top_p", 0, 1, True)):
        if body.get(key) is not None:
            if (err := number_problem(body[key], f"body.{key}", lo, hi, lo_open=lo_open)):
                return p, err
            p[key] = float(body[key])
    for key, hi in (("top_k", 1 << 31), ("seed", (1 << 63) - 1)):
        if body.get(key) is not None:
            if (err := integer_problem(body[key], f"body.{key}", 0, hi)):
                return p, err
            p[key] = body[key]
    if body.get("stop") is not None:
        stop, err = stop_strings(body["stop"], "body.stop")
        if err:
            return p, err
        p["stop"] = list(stop)
    return p, None


def _rerank(body: dict[str, Any], ordinal: int, rid: str, here: str) -> InputRecord:
    """A /v1/rerank body -> a record of task score's list form: fields `query` and `documents`
    (strings, or {"text": ...} objects), and `top_n` as a per-line param."""
    for key, value in body.items():
        if key not in IGNORED | {"query", "documents", "top_n", "return_documents"}:
            return _error(ordinal, rid, "unsupported_parameter", f"{here}: body.{key} is not supported for "
                                                                 f"{RERANK}; remove it")
    if body.get("return_documents") not in (None, False):
        return _error(ordinal, rid, "unsupported_return_documents", f"{here}: return_documents is not supported; "
                      "results[].index points into the line's own documents")
    query, docs = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not query.strip() or unicode_problem(query):
        return _error(ordinal, rid, "invalid_query", f"{here}: body.query must be a non-empty string")
    if isinstance(docs, list):
        docs = [d.get("text") if isinstance(d, dict) and set(d) == {"text"} else d for d in docs]
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) and d.strip() and not unicode_problem(d)
                                                         for d in docs):
        return _error(ordinal, rid, "invalid_documents", f"{here}: body.documents must be a non-empty list of "
                                                         "non-empty strings (or {\"text\": ...} objects)")
    params: dict[str, Any] = {}
    if body.get("top_n") is not None:
        if (err := integer_problem(body["top_n"], "body.top_n", 1, 1 << 31)):
            return _error(ordinal, rid, "invalid_parameter", f"{here}: {err}")
        params["top_n"] = body["top_n"]
    return InputRecord(ordinal, rid, None, params=params, endpoint=RERANK,
                       fields={"query": query, "documents": docs})


def _images(body: dict[str, Any], ordinal: int, rid: str, here: str) -> InputRecord:
    """A /v1/images/generations body -> a record of task generate_image: fields `prompt`,
    `num_images` (body.n) and `width` / `height` (body.size "WxH"; "auto" or none: the job's or the
    bundle's), and `response_format` (url, the default, or b64_json) as a per-line param."""
    for key in body:
        if key not in IGNORED | {"prompt", "n", "size", "response_format"}:
            return _error(ordinal, rid, "unsupported_parameter", f"{here}: body.{key} is not supported for "
                                                                 f"{IMAGES}; remove it")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip() or unicode_problem(prompt):
        return _error(ordinal, rid, "invalid_prompt", f"{here}: body.prompt must be a non-empty string")
    fields: dict[str, Any] = {"prompt": prompt}
    if body.get("n") is not None:
        if (err := integer_problem(body["n"], "body.n", 1, MAX_IMAGES_PER_LINE)):
            return _error(ordinal, rid, "invalid_parameter", f"{here}: {err}")
        fields["num_images"] = body["n"]
    size = body.get("size")
    if size not in (None, "auto"):
        parts = size.split("x") if isinstance(size, str) else []
        if len(parts) != 2 or not all(p.isdigit() and 0 < len(p) <= 6 for p in parts):
            return _error(ordinal, rid, "invalid_parameter", f"{here}: body.size {size!r:.40} must be \"WIDTHxHEIGHT\" "
                                                             "(e.g. \"512x512\") or \"auto\"")
        fields["width"], fields["height"] = int(parts[0]), int(parts[1])
    fmt = body.get("response_format")
    if fmt not in (None, *IMAGE_FORMATS):
        return _error(ordinal, rid, "invalid_parameter", f"{here}: body.response_format must be \"url\" or "
                                                         f"\"b64_json\", got {fmt!r:.40}")
    return InputRecord(ordinal, rid, None, params={"response_format": fmt or "url"}, endpoint=IMAGES, fields=fields)


def _structured(body: dict[str, Any], p: dict[str, Any]) -> str | None:
    """A chat line's response_format, logprobs and top_logprobs into `p`, or what is wrong."""
    if body.get("response_format") is not None:
        if (err := response_format_problem(body["response_format"], "body.response_format")):
            return err
        p["response_format"] = body["response_format"]
    if body.get("logprobs") is not None:
        if not isinstance(body["logprobs"], bool):
            return f"body.logprobs must be true or false, got {body['logprobs']!r:.40}"
        p["logprobs"] = body["logprobs"]        # false too: it overrides a job's logprobs: true
    if body.get("top_logprobs") is not None:
        if (err := integer_problem(body["top_logprobs"], "body.top_logprobs", 0, MAX_TOP_LOGPROBS)):
            return err
        if not body.get("logprobs"):
            return "body.top_logprobs needs body.logprobs: true"
        p["top_logprobs"] = body["top_logprobs"]
    return None
