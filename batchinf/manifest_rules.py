"""Field rules of the job manifest, and the translation of pydantic's errors into ours.

A rule is written once and serves three ends: pydantic validates a field with it, the JSON
Schema shows it, and a value it refuses gets a message naming the field by its path
(`options.top_p`) and the fix. `manifest_error` turns a pydantic ValidationError into that
ManifestError, so pydantic's own wording never reaches a user.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import core_schema

from batchinf.checks import integer_problem, number_problem, stop_strings
from batchinf.errors import ManifestError


class Section(BaseModel):
    """A manifest or a section of one: immutable, unknown keys refused. (Built in Python with a bad
    value, a section raises pydantic's ValidationError; a document gets ManifestError.)"""
    model_config = ConfigDict(extra="forbid", frozen=True)


class Refused(ValueError):
    """A value a rule refused, or a problem of the whole manifest; pydantic carries it to manifest_error."""

    def __init__(self, text: str, rule: Rule | None = None, value: Any = None) -> None:
        super().__init__(text)
        self.rule, self.value = rule, value

    def message(self, where: str) -> str:
        """The message for the field at `where` (a rule's), or the text as given."""
        return (self.rule.problem(self.value, where) if self.rule else None) or str(self)


@dataclass(frozen=True)
class Rule:
    """One field's rule; used as `Annotated[T, rule]` on a model field."""
    problem: Callable[[Any, str], str | None]   # (value, field path) -> what is wrong, or None
    schema: dict[str, Any]                      # the accepted values, as JSON Schema
    convert: Callable[[Any], Any] = lambda v: v  # an accepted value -> the attribute's value

    def validate(self, v: Any) -> Any:
        problem = self.problem(v, "the value")
        if problem is not None:
            raise Refused(problem, self, v)
        return self.convert(v)

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(self.validate)

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        return dict(self.schema)


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__


# --- the rules the manifest uses ----------------------------------------------------------------


INT64_MAX, INT64_MIN = (1 << 63) - 1, -(1 << 63)     # what the ledger's columns hold
INT32_MAX = (1 << 31) - 1        # POSITIVE's ceiling: a field with no natural bound of its own
# ceilings of the options no operator limit covers (far above any real bundle)
MAX_LENGTH = 1 << 20             # tokens of one record (max_length)
MAX_DIMENSIONS = 1 << 16         # an embedding's size
MAX_LABELS = 1 << 20             # top_k / top_n: labels or documents listed


def integer(lo: int | None = None, hi: int = INT64_MAX) -> Rule:
    """An integer in [lo, hi] (booleans are not integers). Every integer has a ceiling (64 bits unless
    given; tests/unit/test_bounded_values.py checks that only operator-limited fields keep that one)."""
    def problem(v: Any, where: str) -> str | None:
        return integer_problem(v, where, lo) or (
            f"{where} {v} is over the limit of {hi}; use at most {hi}" if v > hi else None)
    return Rule(problem, {"type": "integer", **({} if lo is None else {"minimum": lo}), "maximum": hi})


def positive(hi: int) -> Rule:
    """An integer in [1, hi]."""
    return integer(1, hi)


# a positive integer the operator bounds at submit (config.LIMITS, limits.check_manifest: 422 naming
# the limit and `batchinf tenant limit`); the rule keeps it to 64 bits
LIMITED = positive(INT64_MAX)


def number(lo: float, hi: float, *, lo_open: bool = False) -> Rule:
    """A real number in [lo, hi], or (lo, hi] with lo_open; kept as a float."""
    bound = {"exclusiveMinimum": lo} if lo_open else {"minimum": lo}
    return Rule(lambda v, w: number_problem(v, w, lo, hi, lo_open=lo_open),
                {"type": "number", **bound, "maximum": hi}, float)


def choice(values: Sequence[str]) -> Rule:
    return Rule(lambda v, w: None if v in values else f"{w} {v!r} is not supported; use one of {', '.join(values)}",
                {"enum": list(values)})


def nullable(rule: Rule, default: Any = None) -> Rule:
    """`rule`, or null, which stands for `default`."""
    schema = dict(rule.schema)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        schema["type"] = [*types, "null"]
    else:
        schema = {"anyOf": [schema, {"type": "null"}]}
    return Rule(lambda v, w: None if v is None else rule.problem(v, w), schema,
                lambda v: default if v is None else rule.convert(v))


class _NullIsDefault:
    """On a field holding a part of the manifest (shards): null stands for that part's defaults."""

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(lambda v: {} if v is None else v, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        return {"anyOf": [handler(schema), {"type": "null"}]}


NULL_IS_DEFAULT = _NullIsDefault()
POSITIVE = positive(INT32_MAX)
STRING = Rule(lambda v, w: None if isinstance(v, str) else f"{w} must be a string, got {v!r:.60}",
              {"type": "string"})
BOOLEAN = Rule(lambda v, w: None if isinstance(v, bool) else f"{w} must be true or false, got {v!r:.60}",
               {"type": "boolean"})
# name and bundle: any value is taken as its text, as it always was, so a YAML date or number works
# (the schema states the intent: a non-empty string)
TEXT = Rule(lambda v, w: None, {"type": "string", "minLength": 1}, str)
MAX_NAME_CHARS = 200            # the ledger's name columns are String(200)


def _name_problem(v: Any, where: str) -> str | None:
    text = str(v)
    if not text:
        return f"{where} is empty; give it a short name"
    bad = next((c for c in text if unicodedata.category(c) in ("Cc", "Cs") or c in "\u2028\u2029"), None)
    if bad is not None:
        return (f"{where} holds the control character {bad!r} (at {text.index(bad)}); a name is printable text, "
                "without NUL, newlines or tabs")
    if len(text) > MAX_NAME_CHARS:
        return f"{where} is {len(text)} characters long, over the limit of {MAX_NAME_CHARS}; use a shorter name"
    return None


# a job's name: printable text of 1 to 256 characters (any YAML value, as its text)
NAME = Rule(_name_problem, {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS,
                            "pattern": "^[^\\u0000-\\u001f\\u007f-\\u009f\\u2028\\u2029]*$"}, str)
KEY = nullable(Rule(lambda v, w: None if isinstance(v, str) and v else f"{w} must be a non-empty string",
                    {"type": "string", "minLength": 1}))


def _stop(v: Any, where: str) -> str | None:
    return stop_strings(list(v) if isinstance(v, tuple) else v, where)[1]


STOP = nullable(Rule(_stop, {"oneOf": [{"type": "string", "minLength": 1},
                                       {"type": "array", "items": {"type": "string", "minLength": 1}}]},
                     lambda v: stop_strings(list(v) if isinstance(v, tuple) else v, "")[0]), ())


def _token_ids(v: Any, where: str) -> str | None:
    ids = list(v) if isinstance(v, tuple) else [] if v is None else v      # null: none
    if isinstance(ids, list) and all(integer_problem(i, where, 0, INT32_MAX) is None for i in ids):
        return None
    return f"{where} must be a list of token ids (integers in [0, {INT32_MAX}]), got {v!r:.60}"


TOKEN_IDS = Rule(_token_ids, {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX}},
                 lambda v: tuple(v or ()))

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


MAX_DURATION_SECONDS = 366 * 86400      # a deadline further than a year out is a mistake


def parse_duration(value: Any, where: str) -> float:
    """90s, 30m, 6h, 1d, or a number of seconds -> seconds (> 0, at most MAX_DURATION_SECONDS)."""
    m = None if isinstance(value, bool) else _DURATION.match(str(value)[:100])
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)] if m else 0.0
    if not seconds > 0:
        raise ManifestError(f"{where}: {value!r:.60} is not a positive duration; write e.g. 90s, 30m, 6h or 1d")
    if seconds > MAX_DURATION_SECONDS:
        raise ManifestError(f"{where}: {value!r:.60} is over the limit of 366 days; write at most 366d")
    return seconds


def _duration_problem(v: Any, where: str) -> str | None:
    try:
        parse_duration(v, where)
    except ManifestError as exc:
        return str(exc)
    return None


DURATION = nullable(Rule(_duration_problem, {"type": ["string", "number"], "exclusiveMinimum": 0,
                                             "maximum": MAX_DURATION_SECONDS}, lambda v: parse_duration(v, "deadline")))

OUTPUT = Rule(lambda v, w: None if isinstance(v, dict) and set(v) == {"uri"} and isinstance(v["uri"], str)
              else f"{w} must be a mapping with exactly one key, uri",
              {"type": "object", "additionalProperties": False, "required": ["uri"],
               "properties": {"uri": {"type": "string", "description": "a prefix: the job's parts, "
                                      "manifest and _SUCCESS are written under it"}}},
              lambda v: v["uri"])


# --- pydantic's errors -> ManifestError ---------------------------------------------------------


def _model_at(model: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The model class a location inside `model` validates with (None: not a single model)."""
    for part in loc:
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _keys(model: type[BaseModel] | None) -> str:
    return ", ".join(sorted(f.alias or n for n, f in (model.model_fields.items() if model else ())))


def _message(err: Any, model: type[BaseModel], where: str, top: str) -> str:
    loc = [str(p) for p in err["loc"]]
    path = ".".join([where, *loc] if where else loc)
    kind, value = err["type"], err.get("input")
    error = (err.get("ctx") or {}).get("error")
    if isinstance(error, Refused):
        return error.message(path)
    if kind in ("extra_forbidden", "invalid_key"):
        parent, key = ".".join([where, *loc[:-1]] if where else loc[:-1]), err["loc"][-1]
        allowed = _keys(_model_at(model, err["loc"][:-1]))
        return (f"unknown key {parent}.{key}; allowed keys: {allowed}" if parent
                else f"unknown key {key!r}; allowed keys: {allowed}")
    if kind == "missing":
        return f"missing required key {path!r}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path} must be a mapping, got {_kind(value)}" if path else top
    return f"{path or 'the manifest'}: {value!r:.60} is not valid"   # not expected: every field has a rule


def _rank(err: Any) -> int:
    """Which error is reported: unknown top-level keys first, then missing ones, then field order."""
    top = len(err["loc"]) == 1
    return 0 if top and err["type"] in ("extra_forbidden", "invalid_key") else 1 if err["type"] == "missing" else 2


def manifest_error(exc: ValidationError, model: type[BaseModel], where: str = "",
                   top: str = "a job manifest must be a mapping") -> ManifestError:
    """The first of pydantic's errors as our ManifestError. `where` is the path of `model` in a
    manifest ("options"); `top` is the message for a document that is not a mapping at all."""
    errors = sorted(exc.errors(include_url=False), key=_rank)
    return ManifestError(_message(errors[0], model, where, top))
