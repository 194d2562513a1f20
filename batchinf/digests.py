"""SHA-256 of files, streamed in fixed-size chunks: the one digest helper behind part digests,
bundle file pins and local-store etags. Depends on nothing in batchinf."""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO


def sha256_fileobj(f: BinaryIO) -> str:
    """Hex sha256 of an open binary file from its current position to the end (read in chunks)."""
    return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of the file at `path`, streamed: memory stays bounded whatever its size."""
    with open(path, "rb") as f:
        return sha256_fileobj(f)
