"""Value checks shared by every surface that accepts tenant-supplied numbers and strings
(job manifests, OpenAI batch lines). Each returns what is wrong, naming `where`, or None."""

from __future__ import annotations

import json
import re
from typing import Any


def number_problem(v: Any, where: str, lo: float, hi: float, *, lo_open: bool = False) -> str | None:
    """A real number in [lo, hi] (or (lo, hi] with lo_open); booleans are not numbers."""
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool)
          and (v > lo if lo_open else v >= lo) and v <= hi)
    return None if ok else f"{where} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r:.60}"


def integer_problem(v: Any, where: str, lo: int | None = None, hi: int | None = None) -> str | None:
    """An integer in [lo, hi]; a bound left out (None) is open. Booleans are not integers."""
    ok = (isinstance(v, int) and not isinstance(v, bool)
          and (lo is None or v >= lo) and (hi is None or v <= hi))
    return None if ok else f"{where} must be {_integers(lo, hi)}, got {v!r:.60}"


def _integers(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"an integer in [{lo}, {hi}]"
    if hi is not None:
        return f"an integer <= {hi}"
    return {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer >= {lo}")


def stop_strings(v: Any, where: str) -> tuple[tuple[str, ...], str | None]:
    """Stop strings: one non-empty string or a list of them -> (tuple, None), or ((), problem)."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        return (), f"{where} must be a non-empty string or a list of them, got {v!r:.60}"
    return tuple(items), None


def clip(text: str | None, limit: int, length: int | None = None) -> str | None:
    """`text` cut to at most `limit` characters, the cut noted with the full length, so a stored or
    shown value (an error row's record id or message) stays bounded whatever a record holds.
    `length`: the full length when `text` is already a prefix of the value."""
    full = len(text) if text is not None and length is None else (length or 0)
    if text is None or full <= limit:
        return text
    note = f"… ({full} characters)"
    return text[:max(0, limit - len(note))] + note


# --- response_format (structured output): shape only; the schema is compiled by runtime/generation/structured.py ---

MAX_SCHEMA_BYTES = 65536        # a response_format's JSON, at most
MAX_TOP_LOGPROBS = 20           # OpenAI's limit
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TYPES = ("text", "json_object", "json_schema")


def response_format_problem(rf: Any, where: str = "response_format") -> str | None:
    """What is wrong with a response_format's shape, or None (the schema itself is checked by
    batchinf.runtime.generation.structured.grammar_problem)."""
    if not isinstance(rf, dict) or rf.get("type") not in TYPES:
        return f"{where} must be an object with type one of {', '.join(TYPES)}"
    extra = set(rf) - {"type", "json_schema"}
    if extra or (rf["type"] != "json_schema" and "json_schema" in rf):
        return f"{where} has unexpected keys {sorted(extra) or ['json_schema']}"
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            return f"{where}.json_schema must be an object with name, schema and optionally strict"
        if set(js) - {"name", "schema", "strict", "description"}:
            return f"{where}.json_schema has unexpected keys {sorted(set(js) - {'name', 'schema', 'strict', 'description'})}"
        if not isinstance(js.get("name"), str) or not _NAME.match(js["name"]):
            return f"{where}.json_schema.name must be 1-64 letters, digits, _ or -"
        if not isinstance(js.get("schema"), dict):
            return f"{where}.json_schema.schema must be a JSON Schema object"
        if not isinstance(js.get("description", ""), str):
            return f"{where}.json_schema.description must be a string"
        if not isinstance(js.get("strict", False), (bool, type(None))):
            return f"{where}.json_schema.strict must be true or false"
    try:
        size = len(json.dumps(rf))
    except (TypeError, ValueError, RecursionError) as e:
        return f"{where} is not plain JSON ({e})"
    if size > MAX_SCHEMA_BYTES:
        return f"{where} is over {MAX_SCHEMA_BYTES} bytes of JSON; use a smaller schema"
    return None


def canonical_response_format(rf: dict[str, Any] | None) -> str | None:
    """The staged form of a response_format: compact JSON with sorted keys, except that every
    `properties` map keeps its order (the order the answer's keys are written in), None for
    plain text."""
    if rf is None or rf.get("type") == "text":
        return None
    return json.dumps(_sorted_but_properties(rf), separators=(",", ":"))


def _sorted_but_properties(node: Any) -> Any:
    if isinstance(node, list):
        return [_sorted_but_properties(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k in sorted(node):
        v = node[k]
        if k == "properties" and isinstance(v, dict):
            out[k] = {name: _sorted_but_properties(schema) for name, schema in v.items()}
        else:
            out[k] = _sorted_but_properties(v)
    return out
