"""A large input object is planned in parts, each its own planning task (its own staged file and
summary), so one 50 GB JSONL is tokenized by many processes.

`object_parts` is the one place that decides: an uncompressed JSONL or Parquet object larger than
BATCHINF_PLAN_RANGE_BYTES (default 64 MiB) is cut into byte ranges of about that size; anything
else (compressed by name, openai-batch, a retry job's objects, a small object) is planned whole.

- JSONL: a part [start, stop) owns every line that starts in it (a line starts at `start` only
  if start is 0 or byte start-1 is a newline); its reader skips the partial line it begins in and
  reads the line that runs past `stop` to its end (formats/jsonl.py `part_objects`).
- Parquet: a part owns the row groups whose first data page starts in it.
- An object that turns out compressed (magic bytes) or not to be JSONL / Parquet at all is read
  whole by its part 0, and its other parts stage nothing.

A part cannot know how many lines precede it without reading them, so its rows are numbered from
its own start (ordinal 0, line 1) and its summary keeps its line and record counts. The global
step (finish.finish_plan) shifts every part's ordinals and the line (row) numbers in its messages by
the prefix sums of the parts before it (`shifts`, `renumber`): ordinals, messages, duplicate ids,
shards and outputs are exactly those of planning the object whole.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinf.config import settings
from batchinf.formats import InputRecord, read_records
from batchinf.formats.compression import CODECS, codec_of
from batchinf.formats.jsonl import HEAD_BYTES, jsonl_records, part_objects, wrong_format
from batchinf.formats.parquet import read_parquet
from batchinf.store import ObjectPin, get_store

SPLITTABLE = ("jsonl", "parquet")


@dataclass(frozen=True)
class Range:
    """Bytes [start, stop) of an object: its `number`-th planning part."""
    number: int
    start: int
    stop: int


def object_parts(pin: ObjectPin, fmt: str, splittable: bool = True) -> list[Range] | None:
    """The object's planning parts, or None when it is planned whole (one task, as always)."""
    size, step = pin.size, settings().plan_range_bytes
    if not splittable or fmt not in SPLITTABLE or size <= step or \
            any(pin.uri.lower().endswith(suffix) for suffix in CODECS):
        return None
    n = -(-size // step)
    cuts = [size * k // n for k in range(n + 1)]
    return [Range(k, cuts[k], cuts[k + 1]) for k in range(n)]


def part_uri(stage_uri: str, part: Range) -> str:
    """plan/obj-00003.parquet -> plan/obj-00003.p0012.parquet"""
    return stage_uri.removesuffix(".parquet") + f".p{part.number:04d}.parquet"


def part_records(task: Any, tally: dict[str, int]) -> Iterator[InputRecord]:
    """The records of the planning task's part (`task`: a context.ObjectTask with a `part`), numbered
    from the part's start; `tally` gets its lines and records."""
    part: Range = task.part
    tally.update(lines=0, records=0)
    with get_store(task.pin.uri).open_ranged(task.pin) as fh:
        if task.fmt == "parquet":
            groups = _row_groups(fh, part)
            if groups is not None:
                yield from read_parquet(fh, task.pin.uri, task.id_field, task.text_field, kind=task.kind,
                                        row_groups=groups, tally=tally)
                return
        else:
            head = fh.read(HEAD_BYTES)
            if codec_of(fh, task.pin.uri) is None and wrong_format(head, task.pin.uri) is None:
                yield from jsonl_records(part_objects(fh, task.pin.uri, part.start, part.stop, tally),
                                         task.id_field, task.text_field, task.kind)
                return
        if part.number == 0:       # compressed, or not this format at all: part 0 reads it whole
            fh.seek(0)
            yield from read_records(fh, task.fmt, task.pin.uri, task.id_field, task.text_field,
                                    kind=task.kind, task=task.task)


def _row_groups(fh: Any, part: Range) -> list[int] | None:
    """The row groups whose first data page starts in the part; None when it is no Parquet file."""
    try:
        meta = pq.ParquetFile(fh).metadata
    except (pa.ArrowException, OSError):
        return None
    finally:
        fh.seek(0)
    return [g for g in range(meta.num_row_groups)
            if part.start <= meta.row_group(g).column(0).data_page_offset < part.stop] \
        if meta.num_columns else []


def shifts(summaries: list[dict[str, Any]], owner: list[int]) -> list[tuple[int, int]]:
    """(records, lines) before each part in its object: the prefix sums of the parts' counts
    (`owner[p]`: the object of part p; an object's parts are consecutive and in order)."""
    out, records, lines = [], 0, 0
    for p, s in enumerate(summaries):
        if p == 0 or owner[p] != owner[p - 1]:
            records = lines = 0
        out.append((records, lines))
        span = s.get("part") or {}
        records, lines = records + span.get("records", 0), lines + span.get("lines", 0)
    return out


_NUMBERED = re.compile(r"(line|row) (\d+)")


def renumber(table: pa.Table, uri: str, records: int, lines: int) -> pa.Table:
    """A part's staged rows numbered in the whole object: ordinals shifted by `records`, and the
    line (JSONL) or row (Parquet) number that starts a reader's message by `lines`."""
    if not records and not lines:
        return table
    at = table.schema.get_field_index("ordinal")
    table = table.set_column(at, "ordinal", pc.add(table.column("ordinal"), pa.scalar(records, pa.int64())))
    prefix = uri + " "

    def fix(msg: str | None) -> str | None:
        m = _NUMBERED.match(msg, len(prefix)) if msg and msg.startswith(prefix) else None
        return msg if m is None else f"{msg[:m.start(2)]}{int(m.group(2)) + lines}{msg[m.end(2):]}"

    at = table.schema.get_field_index("message")
    return table.set_column(at, "message", pa.array([fix(m) for m in table.column("message").to_pylist()],
                                                    pa.string()))


def combined(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One object's summary from its parts' (summary.summarize): counts and histograms
    added up; the id samples stay per part (the duplicate check reads the parts' ids files)."""
    if len(summaries) == 1:
        return summaries[0]
    out: dict[str, Any] = {k: sum(s.get(k, 0) for s in summaries)
                           for k in ("rows", "records", "continued", "tokens", "truncated", "ids")}
    for key in ("valid", "invalid", "valid_extra"):
        total: Counter[int] = Counter()
        for s in summaries:
            total.update({int(L): int(c) for L, c in s.get(key, [])})
        out[key] = [[L, c] for L, c in sorted(total.items())]
    codes: Counter[str] = Counter()
    for s in summaries:
        codes.update(s["invalid_by_code"])
    out["invalid_by_code"] = dict(codes)
    return out
