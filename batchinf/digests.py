"""SHA-256 of files, streamed in fixed-size chunks: the one digest helper behind part digests,
bundle file pins and local-store etags. Depends on nothing in batchinf."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from typing import BinaryIO


def sha256_fileobj(f: BinaryIO) -> str:
    """Hex sha256 of an open binary file from its current position to the end (read in chunks)."""
    return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of the file at `path`, streamed: memory stays bounded whatever its size."""
    with open(path, "rb") as f:
        return sha256_fileobj(f)


RACY_SECONDS = 2.0   # a file changed this recently is not remembered: timestamps are coarse (like git's racy entries)


def _identity(path: str | os.PathLike[str]) -> list[int]:
    """What changes whenever the file's bytes may have: inode, size, mtime, and ctime (which no
    unprivileged process can set back, so restoring the mtime after an edit does not hide it)."""
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def sha256_file_cached(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None) -> str:
    """`sha256_file`, remembered per machine in `cache_dir` (keyed by the file's real path) for as
    long as the file's identity (`_identity`) is unchanged: a bundle verified once is not re-hashed
    by every worker process. A missing, unreadable or stale cache entry just hashes again."""
    if cache_dir is None:
        return sha256_file(path)
    real = os.path.realpath(path)
    entry = os.path.join(cache_dir, hashlib.sha256(real.encode()).hexdigest() + ".json")
    before = _identity(real)
    try:
        with open(entry) as f:
            seen = json.load(f)
        if seen.get("path") == real and seen.get("identity") == before and isinstance(seen.get("sha256"), str):
            return seen["sha256"]
    except (OSError, ValueError):
        pass
    digest = sha256_file(real)
    if _identity(real) == before and time.time() - before[4] / 1e9 > RACY_SECONDS:   # settled, unchanged while read
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"path": real, "identity": before, "sha256": digest}, f)
        os.replace(tmp, entry)
    return digest
