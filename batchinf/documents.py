"""Bounded parsing of the YAML and JSON documents a tenant sends (job manifests): a document that
is too big, too deep, too many nodes, uses YAML anchors/aliases, or holds an integer beyond 64
bits is refused with a DocumentError naming the limit, before it can cost the server more than a
small, fixed amount of CPU and memory.

YAML aliases survive `yaml.safe_load`: 450 bytes of nested aliases expand to tens of megabytes
(a "billion laughs"). A manifest never needs them, so the document's parse events are scanned first
(libyaml, milliseconds for 1 MiB): anchors and aliases are refused outright, and nodes and depth
are counted, stopping at the first one over; only then are values built, by the safe loader.

Numbers are bounded before they are built: YAML 1.1 resolves plain scalars such as 0x…, 0o…, 0b…,
1_000 and base-60 59:59:… to integers or floats, and building a long one costs quadratic time (300 KB
of base 60: 17 s) and a Python int past 64 bits. So a plain scalar that resolves to an int or a float
and is longer than MAX_NUMBER_CHARS is refused in the scan, whatever its spelling; JSON numbers go
through the same bound (`json.loads`' parse_int/parse_float).
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from batchinf.errors import BatchinfError

MAX_DOCUMENT_BYTES = 1 << 20     # a manifest is a few hundred bytes; 1 MiB leaves room for long stop lists
MAX_DEPTH = 32                   # nested mappings/lists; a manifest needs 3
MAX_NODES = 10_000               # scalars, lists and mappings together
INT_MAX, INT_MIN = (1 << 63) - 1, -(1 << 63)
MAX_NUMBER_CHARS = 100           # a 64-bit integer is 20 digits (64 in binary with 0b; more with _ separators)
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


class DocumentError(BatchinfError):
    """A document that cannot be parsed, or that is over a limit; the message names which and the fix."""


# libyaml when present (a 1 MiB document scans in milliseconds), else PyYAML's pure-Python parser
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_RESOLVER = yaml.resolver.Resolver()    # the loader's implicit tags: which plain scalars become numbers
_RADIX = re.compile(r"[-+]?0[oOxXbB][0-9a-fA-F_]+\Z")


def _too_long(text: str, where: str) -> DocumentError:
    return DocumentError(f"{where}: the number {text[:20]}… is {len(text)} characters long, over the limit of "
                         f"{MAX_NUMBER_CHARS}; numbers in a manifest are integers that fit in 64 bits or "
                         "plain decimals (write a long value as a quoted string if it is text)")


def _number_problem(event: Any, line: Any) -> DocumentError | None:
    """A scalar the loader would build as an int or a float (its tag, explicit !!int / !!float or
    resolved from a plain scalar) from more than MAX_NUMBER_CHARS characters; also a long plain
    scalar spelled as a YAML 1.2 number (0o17, 0X1F), which YAML 1.1 leaves as text. Checked before
    anything is built: the resolver's patterns are linear."""
    text = event.value
    if len(text) <= MAX_NUMBER_CHARS:
        return None
    # a quoted scalar is text; "! 0x…" is resolved as if plain (libyaml's loader does)
    plain = event.tag == "!" or (event.tag is None and not event.style)     # plain style: "" (libyaml) or None
    tag = _RESOLVER.resolve(yaml.ScalarNode, text, (True, False)) if plain else event.tag
    if tag in _NUMBER_TAGS or (plain and _RADIX.match(text)):
        return _too_long(text, f"line {line}")
    return None


def _scan_yaml(text: str) -> None:
    """Walk the document's parse events (no values built yet): refuse anchors and aliases, and
    stop at the first event past MAX_NODES or MAX_DEPTH."""
    depth = nodes = 0
    for event in yaml.parse(text, Loader=_LOADER):
        line = event.start_mark.line + 1 if event.start_mark else "?"
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise DocumentError(f"YAML anchors and aliases (&name, *name; line {line}) are not accepted in a "
                                "manifest; write the value out in full")
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise DocumentError(f"the YAML document nests deeper than {MAX_DEPTH} levels (line {line}); "
                                    "a manifest needs 3")
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1
        if isinstance(event, yaml.ScalarEvent) and (problem := _number_problem(event, line)):
            raise problem
        if isinstance(event, (yaml.ScalarEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            nodes += 1
            if nodes > MAX_NODES:
                raise DocumentError(f"the YAML document has more than {MAX_NODES} values (line {line}); "
                                    "a manifest needs a few dozen")


def _check_tree(doc: Any) -> None:
    """Depth, node count and integer range of a parsed document, without recursion."""
    stack: list[tuple[Any, int, str]] = [(doc, 1, "")]
    nodes = 0
    while stack:
        value, depth, where = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise DocumentError(f"the document has more than {MAX_NODES} values; a manifest needs a few dozen")
        if depth > MAX_DEPTH:
            raise DocumentError(f"the document nests deeper than {MAX_DEPTH} levels (at {where[:60] or 'the top'}); "
                                "a manifest needs 3")
        if isinstance(value, dict):
            stack += [(k, depth + 1, where) for k in value]
            stack += [(v, depth + 1, f"{where}.{k}".lstrip(".")) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value)]
        elif isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
            # (str() of a long int is quadratic and raises past 4300 digits: its bit length only)
            raise DocumentError(f"{where or 'the document'}: the integer of {value.bit_length()} bits is out of "
                                "range; integers must fit in 64 bits")


def _json_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise _too_long(text, "JSON")
    return int(text)


def _json_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise _too_long(text, "JSON")
    return float(text)


def parse_document(data: bytes | str, kind: str) -> Any:
    """`data` parsed as `kind` ("json" or "yaml"), within the limits above, or DocumentError."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise DocumentError(f"the document is {len(data)} bytes, over the limit of {MAX_DOCUMENT_BYTES}; "
                            "a manifest is a few hundred bytes")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise DocumentError("the manifest is not UTF-8 text") from None
    label = "JSON" if kind == "json" else "YAML"
    try:
        if kind == "json":
            doc = json.loads(data, parse_int=_json_int, parse_float=_json_float)
        else:
            _scan_yaml(data)
            doc = yaml.load(data, Loader=_LOADER)   # noqa: S506 -- a safe loader; the scan refused aliases
    except DocumentError:
        raise
    except RecursionError:
        raise DocumentError(f"the {label} document nests too deeply; a manifest needs 3 levels") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):     # int() past sys.get_int_max_str_digits()
            raise DocumentError(f"the {label} document holds an integer of thousands of digits; integers "
                                "must fit in 64 bits") from None
        raise DocumentError(f"the manifest is not valid {label}: {str(exc)[:300]}") from None
    except yaml.YAMLError as exc:
        raise DocumentError(f"the manifest is not valid {label}: {str(exc)[:300]}") from None
    _check_tree(doc)
    return doc
