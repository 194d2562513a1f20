"""Bounded parsing of the YAML and JSON documents a tenant sends (job manifests): a document that
is too big, too deep, too many nodes, uses YAML anchors/aliases, or holds an integer beyond 64
bits is refused with a DocumentError naming the limit, before it can cost the server more than a
small, fixed amount of CPU and memory.

YAML aliases survive `yaml.safe_load`: 450 bytes of nested aliases expand to tens of megabytes
(a "billion laughs"). A manifest never needs them, so the document's parse events are scanned first
(libyaml, milliseconds for 1 MiB): anchors and aliases are refused outright, and nodes and depth
are counted, stopping at the first one over; only then are values built, by the safe loader.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from batchinf.errors import BatchinfError

MAX_DOCUMENT_BYTES = 1 << 20     # a manifest is a few hundred bytes; 1 MiB leaves room for long stop lists
MAX_DEPTH = 32                   # nested mappings/lists; a manifest needs 3
MAX_NODES = 10_000               # scalars, lists and mappings together
INT_MAX, INT_MIN = (1 << 63) - 1, -(1 << 63)


class DocumentError(BatchinfError):
    """A document that cannot be parsed, or that is over a limit; the message names which and the fix."""


# libyaml when present (a 1 MiB document scans in milliseconds), else PyYAML's pure-Python parser
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


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
            raise DocumentError(f"{where or 'the document'}: the integer {str(value)[:20]}… ({len(str(abs(value)))} "
                                "digits) is out of range; integers must fit in 64 bits")


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
            doc = json.loads(data)
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
