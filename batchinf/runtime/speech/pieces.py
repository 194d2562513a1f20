"""A long file in pieces: its windows (one plan for the whole file, runtime/speech/windows.py)
cut into runs of consecutive windows, each staged as a row of its own so that the runs spread
over shards and workers (`piece_runs`), and the file's transcript stitched back from the
pieces' outputs at publish (`stitch_pieces`), equal to what one run over all its windows gives:
a window is decoded on its own, whichever piece holds it, and its times are the file's.

Plain Python over dicts (rows of tasks/transcribe.py's PIECE_SCHEMA), so it is tested without a
model or a job."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchinf.runtime.speech.segments import restitch

NO_SPEECH = ("is not silent yet gives no speech: noise, music, or a damaged file that decodes as noise; "
             "check that the file plays")


def piece_runs(windows: list[tuple[int, int]], max_samples: int) -> list[tuple[int, int]]:
    """The file's windows (in order, covering it) in runs [i, j) of consecutive windows spanning
    at most `max_samples` each (a window longer than that alone): one run for a file that fits.
    As few runs as that takes, as even as they get (the longest as short as it can be), so the
    pieces of a file, and the shards they land in, hold about the same work."""
    runs = _greedy_runs(windows, max_samples)
    lo, hi = 0, max_samples
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_runs(windows, mid)) <= len(runs):
            hi = mid
        else:
            lo = mid + 1
    return _greedy_runs(windows, lo)


def _greedy_runs(windows: list[tuple[int, int]], max_samples: int) -> list[tuple[int, int]]:
    runs, i = [], 0
    while i < len(windows):
        j = i + 1
        while j < len(windows) and windows[j][1] - windows[i][0] <= max_samples:
            j += 1
        runs.append((i, j))
        i = j
    return runs


@dataclass
class Stitched:
    """One file from its pieces: its transcript fields (`result`: text, segments, language,
    output_tokens) or its error (`error`: code, `message`, `attempts`, and the `piece` it is
    charged to: the failed one, else the first)."""
    result: dict[str, Any] | None = None
    error: str | None = None
    message: str = ""
    attempts: int = 0
    piece: int = 0


def majority(languages: list[str | None]) -> str:
    """The language most windows gave (the first of them on a tie); `en` when none gave one."""
    return max(dict.fromkeys(languages), key=languages.count, default=None) or "en"


def missing_pieces(rows: list[dict[str, Any]]) -> str | None:
    """What is missing from one file's piece rows (any order), or None when every piece is there
    once. Raises ValueError for rows that disagree (a piece twice, other piece counts)."""
    count = rows[0]["pieces"]
    numbers = sorted(r["piece"] for r in rows)
    if any(r["pieces"] != count for r in rows) or len(set(numbers)) != len(numbers) or \
            not all(0 <= n < count for n in numbers):
        raise ValueError(f"record {rows[0]['record_id']!r} ({rows[0]['source']} record {rows[0]['ordinal']}): "
                         f"pieces {numbers} of {sorted({r['pieces'] for r in rows})} do not fit together")
    if len(numbers) == count:
        return None
    have = set(numbers)
    return f"pieces {[n for n in range(count) if n not in have]} of {count} not done"


def stitch_pieces(rows: list[dict[str, Any]]) -> Stitched:
    """Every piece of one file (rows of PIECE_SCHEMA as dicts, any order; `missing_pieces` is
    None) -> the file: failed with its first failed piece's reason (that names the window and its
    times in the file) when any piece failed; else its segments in order (ids from 0, times
    monotonic), `text` joined from them as one run joins it, the language most windows gave,
    output tokens summed; `no_speech_found` when that text is empty yet the file is not silent."""
    rows = sorted(rows, key=lambda r: r["piece"])
    bad = next((r for r in rows if r["error"] is not None), None)
    if bad is not None:
        return Stitched(error=bad["error"], message=bad["message"], attempts=bad["attempts"] or 0, piece=bad["piece"])
    text, segments = restitch([s for r in rows for s in r["segments"]])
    if not text and not rows[0]["silent"]:
        return Stitched(error="no_speech_found", message=f"record {rows[0]['record_id']!r}: audio file "
                                                           f"{rows[0]['source']} {NO_SPEECH}",
                        attempts=max(r["attempts"] or 0 for r in rows))
    return Stitched(result={"text": text, "segments": segments,
                            "language": majority([lang for r in rows for lang in r["languages"]]),
                            "output_tokens": sum(r["output_tokens"] for r in rows)})
