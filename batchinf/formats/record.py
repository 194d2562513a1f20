"""The input record every reader yields, and the checks shared by all input formats.

A record carries the text to embed, a plain prompt, or chat messages (task generate), by the
`kind` its reader is given; openai-batch lines also carry per-record sampling overrides and
their endpoint. A record that cannot be used carries an error code and a message that says what
is wrong and what to do, instead of its content: bad records are error rows, never exceptions.

Every record is identified by (source object, ordinal): the ordinal counts the object's records
(non-blank JSONL lines, Parquet rows) from 0, so coverage can be checked even for records whose
id is missing or duplicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class InputRecord:
    ordinal: int
    record_id: str | None
    text: str | None
    error: str | None = None      # error code when the record is unusable
    message: str | None = None
    messages: list[dict[str, str]] | None = None   # chat messages [{role, content}] (generate)
    params: dict[str, Any] | None = None           # per-record overrides of the job's options
    endpoint: str | None = None                    # openai-batch: the line's url
    fields: dict[str, Any] | None = None           # kind record: the whole record, checked by its task
    items: tuple[Any, ...] | None = None           # openai-batch embeddings: a list input (strings or token-id tuples)


MAX_LINE_BYTES = 64 << 20   # a longer JSONL line or text value becomes an error row
FIELD_KEY = {"text": "input.text_field", "prompt": "input.prompt_field", "messages": "input.messages_field"}
ROLES = ("system", "developer", "user", "assistant")


def check_messages(value: object) -> tuple[list[dict[str, str]] | None, str | None]:
    """Chat messages -> ([{role, content}], None), or (None, what is wrong). Content may be a
    string or a list of text parts ({"type": "text", "text": ...}), which are joined."""
    if not isinstance(value, list) or not value:
        return None, f"must be a non-empty list of {{role, content}} objects, got {_kind(value)}"
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return None, f"message {i} must be an object with role and content, got {_kind(m)}"
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            return None, f"message {i} has role {role!r}; supported roles: {', '.join(ROLES)}"
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                return None, (f"message {i} content has a part that is not text; only text parts "
                              "({\"type\": \"text\", \"text\": ...}) are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            return None, f"message {i} content must be a string, got {_kind(content)}"
        bad = unicode_problem(content)
        if bad:
            return None, f"message {i} content is not valid Unicode ({bad})"
        out.append({"role": role, "content": content})
    if out[-1]["role"] == "assistant":
        return None, "the last message is the assistant's; end with a user message to get an answer"
    return out, None


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def unicode_problem(text: str) -> str | None:
    """What makes `text` unencodable as UTF-8 (a lone surrogate from a bad escape), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{exc.reason} at character {exc.start}"
    return None


def record_id_of(value: object) -> str | None:
    """A record id as a string: strings and integers (not booleans) that are not empty; else None."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (str, int)):
        s = str(value)
        return s if s else None
    return None


def _check(ordinal: int, rid_raw: object, value: object, where: str, id_field: str,
           field: str, kind: str = "text") -> InputRecord:
    """One record from its raw id and content field (JSONL object or Parquet row), or its error."""
    rid = record_id_of(rid_raw)
    if rid is None:
        what = "missing" if rid_raw is None else f"not a string or integer ({rid_raw!r:.40})"
        return InputRecord(ordinal, None, None, "missing_id",
                           f"{where}: id field {id_field!r} is {what}; every record needs a unique "
                           f"string or integer id (set input.id_field if it has another name)")
    if kind == "record":      # the task reads the fields it needs (score, classify_image)
        return InputRecord(ordinal, rid, None, fields=value if isinstance(value, dict) else {})
    if value is None:
        return InputRecord(ordinal, rid, None, f"missing_{kind}",
                           f"{where}: record {rid!r} has no {kind} field {field!r} "
                           f"(set {FIELD_KEY[kind]} if it has another name)")
    if kind == "messages":
        messages, problem = check_messages(value)
        if problem:
            return InputRecord(ordinal, rid, None, "invalid_messages",
                               f"{where}: record {rid!r} field {field!r} {problem}")
        return InputRecord(ordinal, rid, None, messages=messages)
    if not isinstance(value, str):
        return InputRecord(ordinal, rid, None, f"invalid_{kind}",
                           f"{where}: record {rid!r} field {field!r} must be a string, "
                           f"got {type(value).__name__}")
    if not value.strip():
        return InputRecord(ordinal, rid, None, f"empty_{kind}",
                           f"{where}: record {rid!r} has empty {kind}; nothing to "
                           f"{'embed' if kind == 'text' else 'generate from'}")
    bad = unicode_problem(value)
    if bad:
        return InputRecord(ordinal, rid, None, "invalid_utf8",
                           f"{where}: record {rid!r} {kind} is not valid Unicode ({bad}); fix the "
                           "escape sequence in the source")
    return InputRecord(ordinal, rid, value)
