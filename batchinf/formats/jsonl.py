"""JSONL input: one JSON object per line, plain or compressed (see compression.py).

Lines are read with a bounded skipper, so a line longer than `max_line_bytes` becomes a
line_too_long error row and is skipped chunk by chunk; memory stays bounded whatever its size.
`json_objects` is shared with the openai-batch reader, which reads the same kind of lines.
Any exception while parsing one line (a 5,000-digit number, an array nested 100,000 deep) is that
line's `malformed_json` row. An object that is no text at all (NUL bytes, a Parquet file) is one
`wrong_format` row for the whole object, naming the fix.
"""

from __future__ import annotations

import json
from typing import Any, BinaryIO, Iterator

import pyarrow as pa

from batchinf.formats.compression import ExpansionLimit, decompressed
from batchinf.formats.record import MAX_LINE_BYTES, InputRecord, _check


SKIP_CHUNK = 1 << 20     # the rest of a line too long to keep is read past this much at a time


def _lines(fh: BinaryIO, limit: int, budget: int | None = None) -> Iterator[bytes | None]:
    """The file's lines; None for a line longer than `limit`, which is skipped chunk by chunk so
    memory stays bounded whatever its size. With `budget`, only the lines that start within the
    next `budget` bytes (the last one read to its end)."""
    pos = 0
    while budget is None or pos < budget:
        line = fh.readline(limit + 1)
        if not line:
            return
        pos += len(line)
        if len(line) > limit and not line.endswith(b"\n"):
            pos += _skip_line(fh, min(limit, SKIP_CHUNK))
            yield None
            continue
        yield line


def _skip_line(fh: BinaryIO, chunk: int) -> int:
    """Read past the rest of the current line (chunk by chunk); the bytes skipped."""
    skipped = 0
    while rest := fh.readline(chunk):
        skipped += len(rest)
        if rest.endswith(b"\n"):
            break
    return skipped


def _json_object(raw: bytes | None, ordinal: int, where: str,
                 max_line_bytes: int) -> dict[str, Any] | InputRecord | None:
    """One line as a JSON object, or its error record; None for a blank line."""
    if raw is None:
        return InputRecord(ordinal, None, None, "line_too_long",
                           f"{where}: longer than {max_line_bytes} bytes; split the record or "
                           "shorten its text")
    if not raw.strip():
        return None
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return InputRecord(ordinal, None, None, "invalid_utf8",
                           f"{where}: invalid UTF-8 at byte {exc.start} of the line; "
                           "re-encode the file as UTF-8")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        at = "" if exc.msg.endswith(" at") else " at"        # ("Unterminated string starting at")
        return InputRecord(ordinal, None, None, "malformed_json",
                           f"{where}: malformed JSON ({exc.msg}{at} column {exc.colno})")
    except Exception as exc:  # noqa: BLE001 -- whatever a hostile line raises is that line's error
        return InputRecord(ordinal, None, None, "malformed_json", f"{where}: malformed JSON ({parse_problem(exc)})")
    if not isinstance(obj, dict):
        return InputRecord(ordinal, None, None, "malformed_json",
                           f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def parse_problem(exc: BaseException) -> str:
    """Why a line that json.loads refused cannot be parsed, and the fix."""
    if isinstance(exc, RecursionError):
        return "nested too deeply to parse; flatten the record"
    if isinstance(exc, ValueError) and "digits" in str(exc):
        return f"{exc}; write such a number as a string"
    return f"{type(exc).__name__}: {str(exc)[:200]}"


HEAD_BYTES = 8192
# Leading bytes of formats that are often uploaded to a JSONL prefix by mistake: (magic, what, fix).
_NOT_JSONL = ((b"PAR1", "looks like Parquet (PAR1 magic)", "set input.format: parquet"),
              (b"PK\x03\x04", "looks like a ZIP archive", "unzip it and upload the JSONL files"),
              (b"ARROW1", "looks like an Arrow IPC file", "convert it to Parquet or JSONL"))


def wrong_format(head: bytes, uri: str) -> InputRecord | None:
    """The one error row of an object whose first bytes show it is not JSONL text, else None."""
    for magic, what, fix in _NOT_JSONL:
        if head.startswith(magic):
            return InputRecord(0, None, None, "wrong_format", f"{uri}: {what}, not JSONL; {fix}")
    odd, even = head[1::2], head[0::2]
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) or (len(head) > 3 and 0 not in even
                                                        and odd.count(0) > 0.9 * len(odd)):
        return InputRecord(0, None, None, "wrong_format",
                           f"{uri}: looks like UTF-16 text, not UTF-8 JSONL; re-encode the file as UTF-8")
    if b"\x00" in head:
        at = head.index(b"\x00")
        return InputRecord(0, None, None, "wrong_format",
                           f"{uri}: contains NUL bytes (first at byte {at}): a binary file, not JSONL text; "
                           "remove it from the input prefix or set input.format to the file's format")
    return None


def _head(stream: BinaryIO, fh: BinaryIO) -> bytes:
    """The object's first bytes (decompressed), leaving the stream where it was."""
    if stream is fh:
        head = fh.read(HEAD_BYTES)
        fh.seek(0)
        return head
    return stream.peek(HEAD_BYTES)[:HEAD_BYTES]  # type: ignore[attr-defined]


def _objects(lines: Iterator[bytes | None], uri: str, max_line_bytes: int, tally: dict[str, int]
             ) -> Iterator[tuple[int, str, dict[str, Any] | InputRecord]]:
    """(ordinal, where, object) per non-blank line, counting lines and records in `tally`."""
    for lineno, raw in enumerate(lines, start=1):
        tally["lines"] = lineno
        ordinal = tally["records"]
        obj = _json_object(raw, ordinal, f"{uri} line {lineno}", max_line_bytes)
        if obj is not None:
            tally["records"] = ordinal + 1
            yield ordinal, f"{uri} line {lineno}", obj


def json_objects(fh: BinaryIO, uri: str, max_line_bytes: int = MAX_LINE_BYTES
                 ) -> Iterator[tuple[int, str, dict[str, Any] | InputRecord]]:
    """(ordinal, where, object) per non-blank line of a plain or compressed object; a line that
    is no JSON object comes as its error record instead. An object that cannot be read to its end
    (a decompression bomb, corrupt compressed data) ends with one error record for its rest."""
    tally = {"lines": 0, "records": 0}
    try:
        stream = decompressed(fh, uri)
        bad = wrong_format(_head(stream, fh), uri)
        if bad is not None:
            yield 0, uri, bad
            return
        yield from _objects(_lines(stream, max_line_bytes), uri, max_line_bytes, tally)
    except ExpansionLimit as exc:
        ordinal = tally["records"]
        yield ordinal, uri, InputRecord(
            ordinal, None, None, "object_too_large",
            f"{uri}: {exc} ({exc.multiple}x its compressed size, see BATCHINF_MAX_EXPANSION); stopped "
            f"after line {tally['lines']}, the rest of the object was not read. Split it into smaller objects")
    except (OSError, EOFError, pa.ArrowInvalid) as exc:
        ordinal = tally["records"]
        yield ordinal, uri, InputRecord(
            ordinal, None, None, "corrupt_object",
            f"{uri}: cannot decompress past line {tally['lines']} ({exc}); the rest of the object was not "
            "read. Re-upload it or fix its compression")


def part_objects(fh: BinaryIO, uri: str, start: int, stop: int, tally: dict[str, int],
                 max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, str, dict[str, Any] | InputRecord]]:
    """`json_objects` of the lines that start in bytes [start, stop) of a plain (uncompressed)
    object, `fh` seekable: a line starting before `start` is skipped, the one running past `stop`
    read to its end. Ordinals and line numbers count from the part's start (0 and 1), and
    `tally` gets the part's lines and records: the global planning step shifts them by those of
    the parts before it (planning/ranges.py). A read error raises (the attempt fails), it is no row."""
    fh.seek(max(0, start - 1))
    skipped = _skip_line(fh, 1 << 20) if start > 0 and fh.read(1) != b"\n" else 0
    tally.update(lines=0, records=0)
    yield from _objects(_lines(fh, max_line_bytes, stop - start - skipped), uri, max_line_bytes, tally)


def read_jsonl(fh: BinaryIO, uri: str, id_field: str, text_field: str,
               max_line_bytes: int = MAX_LINE_BYTES, *, kind: str = "text") -> Iterator[InputRecord]:
    """Records of a JSONL object: `id_field` is the record id, `text_field` is read as `kind`
    (text, prompt or messages)."""
    return jsonl_records(json_objects(fh, uri, max_line_bytes), id_field, text_field, kind)


def jsonl_records(objects: Iterator[tuple[int, str, dict[str, Any] | InputRecord]], id_field: str,
                  text_field: str, kind: str = "text") -> Iterator[InputRecord]:
    """The records of `json_objects` (or `part_objects`)."""
    for ordinal, where, obj in objects:
        if isinstance(obj, InputRecord):
            yield obj
            continue
        try:
            value = obj if kind == "record" else obj.get(text_field)
            yield _check(ordinal, obj.get(id_field), value, where, id_field, text_field, kind)
        except Exception as exc:  # noqa: BLE001 -- a value that breaks the checks fails its record only
            yield InputRecord(ordinal, None, None, "malformed_json", f"{where}: malformed record ({parse_problem(exc)})")
