"""OpenAI batch input files: request lines in, records out (the `openai-batch` input format).

One request per line, `{"custom_id", "method": "POST", "url", "body"}` for
`/v1/chat/completions` (body.messages), `/v1/completions` (body.prompt, one string) and
`/v1/embeddings` (body.input, one string). The custom_id is the record id; a line's url must suit
the job's task (chat and completions: generate; embeddings: embed). Sampling fields of the body
(max_tokens / max_completion_tokens, temperature, top_p, top_k, seed, stop) and, for chat lines,
response_format (json_object, json_schema), logprobs and top_logprobs override the job's options for
that line and are checked like the manifest's options (batchinf.checks); a schema that cannot be
enforced is found when the job is planned, and is that line's error row. Body keys
that do not change the answer (IGNORED) are accepted and ignored; anything batchinf cannot honour
(_NOT_SUPPORTED, unknown keys) becomes the line's error row, saying why and what to do -- never
a silently different answer. The response lines are rendered by batchinf.openai_output.
"""

from __future__ import annotations

from typing import Any, BinaryIO, Iterator

from batchinf.checks import (MAX_TOP_LOGPROBS, integer_problem, number_problem, response_format_problem,
                             stop_strings)
from batchinf.formats.jsonl import parse_problem, json_objects
from batchinf.formats.record import InputRecord, check_messages, record_id_of, unicode_problem

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
ENDPOINT_TASK = {CHAT: "generate", COMPLETIONS: "generate", EMBEDDINGS: "embed"}

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
    "encoding_format": (lambda v: v in (None, "float"), "only encoding_format float is supported"),
    "dimensions": (lambda v: v is None, "dimensions is not supported: the bundle's embedding size is fixed"),
}
_CONTENT = {CHAT: "messages", COMPLETIONS: "prompt", EMBEDDINGS: "input"}
_SAMPLING = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
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
                      f"{here}: url {url!r} is not supported; use {CHAT}, {COMPLETIONS} or {EMBEDDINGS}")
    if ENDPOINT_TASK[url] != task:
        return _error(ordinal, rid, "endpoint_mismatch",
                      f"{here}: url {url} needs a job with task: {ENDPOINT_TASK[url]}, this job's task is "
                      f"{task}; put {url} lines in their own file and job")
    if not isinstance(body, dict):
        return _error(ordinal, rid, "invalid_body", f"{here}: body must be a JSON object, got "
                                                    f"{type(body).__name__ if body is not None else 'null'}")
    known = IGNORED | set(_NOT_SUPPORTED) | {_CONTENT[url]} | (_SAMPLING if url != EMBEDDINGS else set())
    for key, value in body.items():
        if key not in known:
            return _error(ordinal, rid, "unsupported_parameter",
                          f"{here}: body.{key} is not supported for {url}; remove it")
        if key in _NOT_SUPPORTED and not _NOT_SUPPORTED[key][0](value) and not (url == CHAT and key in _CHAT_ONLY):
            return _error(ordinal, rid, f"unsupported_{key}", f"{here}: body.{key}={value!r:.60}: "
                                                              f"{_NOT_SUPPORTED[key][1]}")
    params, problem = _sampling(body) if url != EMBEDDINGS else ({}, None)
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
