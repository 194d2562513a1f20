"""Generated corpora for tests: heavy-tailed text lengths, plus every kind of bad record."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

WORDS = ("the quick brown fox jumps over lazy dog batch inference model shard ledger record "
         "object storage token length bucket padding worker lease commit verify publish").split()


def texts(n: int, seed: int = 0, median_words: int = 8) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = max(1, int(rng.paretovariate(1.6) * median_words / 1.5))
        out.append(" ".join(rng.choice(WORDS) for _ in range(min(k, 400))))
    return out


BAD_LINES: list[tuple[bytes, str]] = [
    (b"{not json", "malformed_json"),
    (b'{"text": "no id here"}', "missing_id"),
    (b'{"id": "no-text"}', "missing_text"),
    (b'{"id": "blank", "text": "   "}', "empty_text"),
    (b'{"id": "bad-bytes", "text": "caf\xff\xfe"}', "invalid_utf8"),
    (b'{"id": "r0", "text": "a duplicate of the first id"}', "duplicate_id"),
]


def write_jsonl(path: Path, n: int, *, seed: int = 0, bad: bool = True, prefix: str = "r") -> dict[str, str]:
    """Write n good records (ids prefix0..), then the BAD_LINES; returns id -> text of good ones."""
    good = {f"{prefix}{i}": t for i, t in enumerate(texts(n, seed))}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for rid, t in good.items():
            f.write(json.dumps({"id": rid, "text": t}).encode() + b"\n")
        if bad:
            for line, _ in BAD_LINES:
                f.write(line + b"\n")
    return good


def record_line(rid: str, text: str) -> bytes:
    return json.dumps({"id": rid, "text": text}).encode()


def awkward_jsonl(seed: int, n: int, prefix: str) -> bytes:
    """n records (ids prefix0..) with blank lines, CRLF endings, every 37th line long, and no
    final newline: what a byte range of a JSONL object may start or end inside."""
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(texts(n, seed)):
        out.append(record_line(f"{prefix}{i}", t if i % 37 else t * 40) + (b"\r\n" if rng.random() < 0.2 else b"\n"))
        if rng.random() < 0.1:
            out.append(b"\n" if rng.random() < 0.5 else b"   \r\n")
    return b"".join(out).rstrip(b"\n")


def manifest(input_uri: str, output_uri: str, bundle: str = "tiny@prod", **extra: object) -> dict:
    m = {"name": "test-embed", "task": "embed", "bundle": bundle,
         "input": {"uri": input_uri, "format": "jsonl"}, "output": {"uri": output_uri},
         "shards": {"max_records": 200}}
    m.update(extra)
    return m


def numbered_lines(n: int) -> list[str]:
    """n JSONL records `{"id": "r<i>", "text": "record number <i>"}`, without newlines."""
    return [json.dumps({"id": f"r{i}", "text": f"record number {i}"}) for i in range(n)]


def bomb(real_lines: int, blank_mib: int) -> bytes:
    """A gzip object of a few real records (r0..), then `blank_mib` MiB of spaces: tiny compressed,
    huge expanded."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [z.compress(("\n".join(numbered_lines(real_lines)) + "\n").encode())]
    block = b" " * (1 << 20)
    parts += [z.compress(block) for _ in range(blank_mib)]
    parts.append(z.flush())
    return b"".join(parts)
