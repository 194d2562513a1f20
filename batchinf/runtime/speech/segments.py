"""Window outputs -> segments with absolute timestamps, and a file's transcript stitched from its
windows in order. Segment fields are those of OpenAI's `verbose_json` transcription (id, seek,
start, end, text, tokens, temperature, avg_logprob, compression_ratio, no_speech_prob), so
existing parsers read them; times are seconds from the file's start, rounded to milliseconds,
and never go backwards."""

from __future__ import annotations

from typing import Any, Callable

TIME_PRECISION = 0.02     # seconds per timestamp token


def window_segments(tokens: list[int], eot: int, timestamp_begin: int, start: float, end: float,
                    decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """One window's tokens -> [{start, end, text, tokens}], times absolute (`start`: the window's
    offset in the file; nothing ends after `end`). Text between two timestamps is a segment; text
    after the last one ends at the window's end; a window without timestamps is one segment."""
    out: list[dict[str, Any]] = []
    text: list[int] = []
    seg_start: float | None = None
    for t in tokens:
        if t >= timestamp_begin:
            at = start + (t - timestamp_begin) * TIME_PRECISION
            if text:
                out.append(_seg(seg_start if seg_start is not None else start, at, text, decode, end))
                text, seg_start = [], None
            else:
                seg_start = at
        elif t < eot:     # text (special tokens aside)
            text.append(t)
    if text:
        out.append(_seg(seg_start if seg_start is not None else start, end, text, decode, end))
    return [s for s in out if s["text"].strip()]


def stopped_short(tokens: list[int], eot: int, timestamp_begin: int, before: float) -> bool:
    """Whether a window's decoding ended by opening a segment (two timestamps, the last one
    earlier than `before` seconds) instead of closing one: the words after it were not said."""
    toks = [t for t in tokens if t >= timestamp_begin or t < eot]
    return (len(toks) >= 3 and toks[-1] >= timestamp_begin and toks[-2] >= timestamp_begin and toks[-3] < eot
            and (toks[-1] - timestamp_begin) * TIME_PRECISION < before)


def _seg(a: float, b: float, tokens: list[int], decode: Callable[[list[int]], str], end: float) -> dict[str, Any]:
    b = min(max(a, b), end)
    return {"start": round(min(a, b), 3), "end": round(b, 3), "text": decode(tokens), "tokens": tokens}


def stitch(windows: list[tuple[float, list[dict[str, Any]], dict[str, Any]]]) -> tuple[str, list[dict[str, Any]]]:
    """[(window start, its segments, its decoding fields)] in window order -> (text, segments):
    ids from 0, `seek` the window's offset in 10 ms frames, times made monotonic."""
    segments, last = [], 0.0
    for w_start, segs, fields in windows:
        for s in segs:
            a = max(s["start"], last)
            b = max(s["end"], a)
            segments.append({"id": len(segments), "seek": int(round(w_start * 100)), "start": a, "end": b,
                             "text": s["text"], "tokens": s["tokens"], "words": s.get("words"), **fields})
            last = b
    return "".join(s["text"] for s in segments).strip(), segments


def restitch(segments: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Segments of several stitched runs of one file's windows (its pieces' transcripts, each
    `stitch`ed on its own, times absolute), in window order -> (text, segments) as `stitch` gives
    them for all the windows at once: ids from 0, times made monotonic across the runs (a run's
    own clamping never changes what the whole file's clamping gives), `seek` and the rest kept."""
    out, last = [], 0.0
    for s in segments:
        a = max(s["start"], last)
        b = max(s["end"], a)
        out.append({**s, "id": len(out), "start": a, "end": b})
        last = b
    return "".join(s["text"] for s in out).strip(), out
