"""Compressed input objects: codec detection and a bounded streaming decompressor.

An object is gzip, bz2 or zstd by its suffix (.gz/.gzip, .bz2, .zst/.zstd) or, whatever its name,
by its magic bytes (a .jsonl that is really gzip). It is decompressed as a stream that refuses to
expand past `settings().max_expansion` (BATCHINF_MAX_EXPANSION) times the object's size, and
never less than MIN_EXPANSION_BYTES: past that it is treated as a decompression bomb and reading
stops with ExpansionLimit, so memory and time stay bounded whatever a hostile object claims.
"""

from __future__ import annotations

import io
import os
from typing import BinaryIO

import pyarrow as pa

from batchinf.config import settings

MIN_EXPANSION_BYTES = 256 << 20
CODECS = {".gz": "gzip", ".gzip": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd"}
MAGIC = {b"\x1f\x8b": "gzip", b"BZh": "bz2", b"\x28\xb5\x2f\xfd": "zstd"}


class ExpansionLimit(Exception):
    """A compressed object expanded past its limit; `multiple` is the expansion factor in force."""

    def __init__(self, limit: int, multiple: int) -> None:
        super().__init__(f"decompresses past {limit} bytes")
        self.limit, self.multiple = limit, multiple


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

    def __init__(self, fh: BinaryIO, codec: str, limit: int, multiple: int) -> None:
        self._src = pa.CompressedInputStream(pa.PythonFile(fh, mode="r"), codec)
        self.limit, self.multiple, self.total = limit, multiple, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray) -> int:  # type: ignore[override]
        data = self._src.read(len(b))
        self.total += len(data)
        if self.total > self.limit:
            raise ExpansionLimit(self.limit, self.multiple)
        b[:len(data)] = data
        return len(data)


def decompressed(fh: BinaryIO, uri: str) -> BinaryIO:
    """`fh` itself, or a bounded decompressing reader over it for .gz/.bz2/.zst objects.
    Reading past the limit raises ExpansionLimit; corrupt data raises OSError, EOFError or
    pyarrow.ArrowInvalid."""
    codec = codec_of(fh, uri)
    if codec is None:
        return fh
    size = fh.seek(0, os.SEEK_END)
    fh.seek(0)
    multiple = settings().max_expansion
    limit = max(MIN_EXPANSION_BYTES, multiple * size)
    return io.BufferedReader(_Decompressed(fh, codec, limit, multiple), buffer_size=1 << 18)  # type: ignore[return-value]
