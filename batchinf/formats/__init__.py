"""Input formats: the registry of record readers, by the manifest's `input.format` name.

A reader turns one pinned object (an open binary file) into InputRecords; a record that cannot
be used is an error record, never an exception. Readers: `jsonl` (one JSON object per line,
plain or compressed), `parquet` (one row per record) and `openai-batch` (OpenAI batch request
lines, which carry their own id, endpoint and sampling overrides) and `audio` (each object one
record: an audio file, task transcribe). FORMATS lists the names a
manifest may give; adding a format is adding a module here and its entry in READERS.
"""

from __future__ import annotations

from typing import BinaryIO, Iterator, Protocol

from batchinf.formats.audio import read_audio
from batchinf.formats.jsonl import read_jsonl
from batchinf.formats.parquet import read_parquet
from batchinf.formats.record import InputRecord

__all__ = ["FORMATS", "READERS", "InputRecord", "Reader", "read_records"]


class Reader(Protocol):
    """Records of one object: `text_field` is read as `kind` (text, prompt or messages); formats
    whose records say what they are themselves (openai-batch) check them against `task`."""

    def __call__(self, fh: BinaryIO, uri: str, id_field: str, text_field: str, *,
                 kind: str, task: str) -> Iterator[InputRecord]: ...


def _jsonl(fh: BinaryIO, uri: str, id_field: str, text_field: str, *,
           kind: str, task: str) -> Iterator[InputRecord]:
    return read_jsonl(fh, uri, id_field, text_field, kind=kind)


def _parquet(fh: BinaryIO, uri: str, id_field: str, text_field: str, *,
             kind: str, task: str) -> Iterator[InputRecord]:
    return read_parquet(fh, uri, id_field, text_field, kind=kind)


def _openai_batch(fh: BinaryIO, uri: str, id_field: str, text_field: str, *,
                  kind: str, task: str) -> Iterator[InputRecord]:
    from batchinf.openai.lines import read_openai_batch   # it reads lines with formats.jsonl: imported late
    return read_openai_batch(fh, uri, task)


def _audio(fh: BinaryIO, uri: str, id_field: str, text_field: str, *,
           kind: str, task: str) -> Iterator[InputRecord]:
    return read_audio(fh, uri)


READERS: dict[str, Reader] = {"jsonl": _jsonl, "parquet": _parquet, "openai-batch": _openai_batch, "audio": _audio}
FORMATS: tuple[str, ...] = tuple(READERS)


def read_records(fh: BinaryIO, fmt: str, uri: str, id_field: str, text_field: str, *,
                 kind: str = "text", task: str = "embed") -> Iterator[InputRecord]:
    """Records of one object in format `fmt`. `text_field` names the field read as `kind` (text,
    prompt or messages); openai-batch lines say what they are themselves and must suit `task`.
    An unknown format raises NotImplementedError naming the supported ones (at the call, not on
    the first record)."""
    reader = READERS.get(fmt)
    if reader is None:
        raise NotImplementedError(f"input format {fmt!r} is not implemented; supported formats: "
                                  f"{', '.join(FORMATS)}")
    return reader(fh, uri, id_field, text_field, kind=kind, task=task)
