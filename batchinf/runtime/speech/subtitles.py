"""Subtitle files from a transcript's segments: SubRip (.srt) and WebVTT (.vtt)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote


def _stamp(seconds: float, sep: str) -> str:
    ms = int(round(max(seconds, 0.0) * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(segments: list[dict[str, Any]]) -> str:
    return "".join(f"{i}\n{_stamp(s['start'], ',')} --> {_stamp(s['end'], ',')}\n{s['text'].strip()}\n\n"
                   for i, s in enumerate(segments, 1))


def vtt(segments: list[dict[str, Any]]) -> str:
    return "WEBVTT\n\n" + "".join(f"{_stamp(s['start'], '.')} --> {_stamp(s['end'], '.')}\n{s['text'].strip()}\n\n"
                                  for s in segments)


RENDERERS = {"srt": srt, "vtt": vtt}


def subtitle_key(fmt: str, record_id: str) -> str:
    """srt/<record id>.srt: the id's path segments kept, each percent-encoded ('..' and empty
    segments too), so a key never leaves its directory."""
    parts = [quote(p, safe="-_.") if p not in ("", ".", "..") else quote(p, safe="").replace(".", "%2E") or "%20"
             for p in record_id.split("/")]
    return f"{fmt}/{'/'.join(parts)}.{fmt}"
