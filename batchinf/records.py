"""Reading input records from pinned objects. Bad records become error records, never exceptions.

A record carries the text to embed, a plain prompt, or chat messages (task generate), by the
`kind` its reader is given; openai-batch lines (openai_batch.py) also carry per-record sampling
overrides and their endpoint.

Every record is identified by (source object, ordinal): the ordinal counts the object's records
(non-blank JSONL lines, Parquet rows) from 0, so coverage can be checked even for records whose
id is missing or duplicated.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator

import pyarrow as pa
import pyarrow.parquet as pq


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
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{exc.reason} at character {exc.start}"
    return None


def record_id_of(value: object) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (str, int)):
        s = str(value)
        return s if s else None
    return None


def _check(ordinal: int, rid_raw: object, value: object, where: str, id_field: str,
           field: str, kind: str = "text") -> InputRecord:
    rid = record_id_of(rid_raw)
    if rid is None:
        what = "missing" if rid_raw is None else f"not a string or integer ({rid_raw!r:.40})"
        return InputRecord(ordinal, None, None, "missing_id",
                           f"{where}: id field {id_field!r} is {what}; every record needs a unique "
                           f"string or integer id (set input.id_field if it has another name)")
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


MAX_LINE_BYTES = 64 << 20   # a longer JSONL line or text value becomes an error row
# A compressed object may expand to this many times its size (and at least MIN_EXPANSION_BYTES);
# past that it is treated as a decompression bomb: an error row for the rest of the object.
MAX_EXPANSION = int(os.environ.get("BATCHINF_MAX_EXPANSION", "200"))
MIN_EXPANSION_BYTES = 256 << 20
PARQUET_BATCH_ROWS = 1024
CODECS = {".gz": "gzip", ".gzip": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd"}
MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bz2", b"\x28\xb5\x2f\xfd": "zstd"}


class ExpansionLimit(Exception):
    pass


def codec_of(fh: BinaryIO, uri: str) -> str | None:
    """The object's compression, by suffix or by magic bytes (a .jsonl that is really gzip)."""
    for suffix, codec in CODECS.items():
        if uri.lower().endswith(suffix):
            return codec
    head = fh.read(4)
    fh.seek(0)
    return next((c for magic, c in MAGIC.items() if head.startswith(magic)), None)


class _Decompressed(io.RawIOBase):
    """A streaming decompressor that refuses to expand past `limit` bytes: memory and time stay
    bounded whatever a hostile object claims."""

    def __init__(self, fh: BinaryIO, codec: str, limit: int) -> None:
        self._src = pa.CompressedInputStream(pa.PythonFile(fh, mode="r"), codec)
        self.limit, self.total = limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        data = self._src.read(len(b))
        self.total += len(data)
        if self.total > self.limit:
            raise ExpansionLimit(f"decompresses past {self.limit} bytes")
        b[:len(data)] = data
        return len(data)


def decompressed(fh: BinaryIO, uri: str) -> BinaryIO:
    """`fh` itself, or a bounded decompressing reader over it for .gz/.bz2/.zst objects."""
    codec = codec_of(fh, uri)
    if codec is None:
        return fh
    size = fh.seek(0, os.SEEK_END)
    fh.seek(0)
    limit = max(MIN_EXPANSION_BYTES, MAX_EXPANSION * size)
    return io.BufferedReader(_Decompressed(fh, codec, limit), buffer_size=1 << 18)  # type: ignore[return-value]


def _lines(fh: BinaryIO, limit: int) -> Iterator[bytes | None]:
    """The file's lines; None for a line longer than `limit`, which is skipped chunk by chunk so
    memory stays bounded whatever the line's size."""
    while True:
        line = fh.readline(limit + 1)
        if not line:
            return
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := fh.readline(limit)) and not rest.endswith(b"\n"):
                pass
            yield None
            continue
        yield line


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
        return InputRecord(ordinal, None, None, "malformed_json",
                           f"{where}: malformed JSON ({exc.msg} at column {exc.colno})")
    if not isinstance(obj, dict):
        return InputRecord(ordinal, None, None, "malformed_json",
                           f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def json_objects(fh: BinaryIO, uri: str, max_line_bytes: int = MAX_LINE_BYTES
                 ) -> Iterator[tuple[int, str, dict[str, Any] | InputRecord]]:
    """(ordinal, where, object) per non-blank line of a plain or compressed object; a line that
    is no JSON object comes as its error record instead. An object that cannot be read to its end
    (a decompression bomb, corrupt compressed data) ends with one error record for its rest."""
    ordinal, lineno = 0, 0
    try:
        for lineno, raw in enumerate(_lines(decompressed(fh, uri), max_line_bytes), start=1):
            obj = _json_object(raw, ordinal, f"{uri} line {lineno}", max_line_bytes)
            if obj is not None:
                yield ordinal, f"{uri} line {lineno}", obj
                ordinal += 1
    except ExpansionLimit as exc:
        yield ordinal, uri, InputRecord(
            ordinal, None, None, "object_too_large",
            f"{uri}: {exc} ({MAX_EXPANSION}x its compressed size, see BATCHINF_MAX_EXPANSION); stopped "
            f"after line {lineno}, the rest of the object was not read. Split it into smaller objects")
    except (OSError, EOFError, pa.ArrowInvalid) as exc:
        yield ordinal, uri, InputRecord(
            ordinal, None, None, "corrupt_object",
            f"{uri}: cannot decompress past line {lineno} ({exc}); the rest of the object was not "
            "read. Re-upload it or fix its compression")


def read_jsonl(fh: BinaryIO, uri: str, id_field: str, text_field: str,
               max_line_bytes: int = MAX_LINE_BYTES, *, kind: str = "text") -> Iterator[InputRecord]:
    for ordinal, where, obj in json_objects(fh, uri, max_line_bytes):
        if isinstance(obj, InputRecord):
            yield obj
        else:
            yield _check(ordinal, obj.get(id_field), obj.get(text_field), where, id_field, text_field, kind)


def read_parquet(fh: BinaryIO, uri: str, id_field: str, text_field: str, *,
                 kind: str = "text") -> Iterator[InputRecord]:
    """Records of a Parquet object, streamed page by page (a buffered stream, no pre-buffering),
    so a file with one enormous row group is read within a fixed memory cap."""
    if codec_of(fh, uri) is not None:
        yield InputRecord(0, None, None, "unsupported_compression",
                          f"{uri}: a compressed Parquet file cannot be read as a stream; Parquet "
                          "compresses its pages itself, so upload it uncompressed (e.g. with "
                          "compression='zstd' inside the file)")
        return
    pf = pq.ParquetFile(fh, buffer_size=1 << 20, pre_buffer=False)
    names = pf.schema_arrow.names
    missing = [f for f in (id_field, text_field) if f not in names]
    if missing:
        msg = (f"{uri}: has no column {missing[0]!r} (columns: {', '.join(names)}); "
               f"set input.id_field / {FIELD_KEY[kind]}")
        for i in range(pf.metadata.num_rows):
            yield InputRecord(i, None, None, "missing_column", msg)
        return
    ordinal = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[id_field, text_field]):
        ids = batch.column(0).to_pylist()
        texts = batch.column(1).to_pylist()
        for rid, text in zip(ids, texts):
            where = f"{uri} row {ordinal}"
            if isinstance(text, str) and len(text) > MAX_LINE_BYTES:
                yield InputRecord(ordinal, record_id_of(rid), None, "record_too_large",
                                  f"{where}: {kind} is longer than {MAX_LINE_BYTES} characters; split "
                                  "the record or shorten it")
            else:
                yield _check(ordinal, rid, text, where, id_field, text_field, kind)
            ordinal += 1


def read_records(fh: BinaryIO, fmt: str, uri: str, id_field: str, text_field: str, *,
                 kind: str = "text", task: str = "embed") -> Iterator[InputRecord]:
    """Records of one object. `text_field` names the field read as `kind` (text, prompt or
    messages); openai-batch lines say what they are themselves and must suit `task`."""
    if fmt == "jsonl":
        return read_jsonl(fh, uri, id_field, text_field, kind=kind)
    if fmt == "parquet":
        return read_parquet(fh, uri, id_field, text_field, kind=kind)
    if fmt == "openai-batch":
        from batchinf.openai_batch import read_openai_batch

        return read_openai_batch(fh, uri, task)
    raise NotImplementedError(f"input format {fmt!r} is not implemented")
