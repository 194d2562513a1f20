"""What names a shard: its deterministic id and its staged file. Planning names the shards it
cuts, and a split or a quarantine names the shards it cuts from one, with the same two functions."""

from __future__ import annotations

import hashlib

from batchinf.store import join


def shard_id(seed: str, members: bytes = b"") -> str:
    """A shard's deterministic id: a hash of what identifies it (job, bucket, ordinal and its
    record set; or, for a split, the parent and the half)."""
    return "sh-" + hashlib.sha256(seed.encode() + members).hexdigest()[:29]


def shard_file(work_uri: str, bucket: int, ordinal: int) -> str:
    return join(work_uri, "shards", f"b{bucket + 1:03d}-{ordinal:05d}.parquet")
