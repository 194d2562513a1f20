"""Short files packed into shared windows: Whisper's encoder always reads 30 s, so a 4-second clip
alone pays for 30 s of encoding. Clips that fit are laid end to end, `GAP_SECONDS` of silence
apart, in one window; the window is decoded with timestamps, and each segment goes back to the
clip it falls in, its times made the clip's own. A segment that runs across the gap between two
clips, or a clip given more words than its sound can hold, is decoded alone (`split_pack` returns
them as unsure), and a pack where a clip with sound gets no text is decoded clip by clip
(tasks/transcribe.py), so packing never costs a word.

Plain functions: `pack_files` chooses the packs (in the order given, so the same rows give the
same packs and a retry the same bytes), `pack_samples` builds a pack's window, `split_pack` hands
its segments back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

GAP_SECONDS = 1.0       # silence between packed clips: Whisper ends a segment at such a pause
SPILL_SECONDS = 0.1     # how much of another clip's sound a segment may cover and still be one clip's
MAX_WORDS_PER_SECOND = 4.5   # more words a second of a clip's sound than fast speech: the timestamps lost


@dataclass(frozen=True)
class Pack:
    """Files laid end to end in one window: `files` (positions), each starting at `offsets` (samples)."""
    files: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def samples(self) -> int:
        return self.offsets[-1] + self.sizes[-1]


def pack_files(sizes: list[int], packable: list[bool], window: int, gap: int) -> tuple[list[Pack], list[int]]:
    """Files (sample counts) -> (packs of two or more files, each at most `window` samples with
    `gap` between files, filled in the order given; files left alone). A file is packable when it
    is one whole window of its own (`packable`)."""
    packs: list[Pack] = []
    alone: list[int] = []
    cur: list[int] = []

    def close() -> None:
        if len(cur) > 1:
            offsets, at = [], 0
            for f in cur:
                offsets.append(at)
                at += sizes[f] + gap
            packs.append(Pack(tuple(cur), tuple(offsets), tuple(sizes[f] for f in cur)))
        else:
            alone.extend(cur)
        cur.clear()

    used = 0
    for f, (n, ok) in enumerate(zip(sizes, packable)):
        if not ok or n == 0 or n + gap > window:
            alone.append(f)
            continue
        if cur and used + gap + n > window:
            close()
            used = 0
        used += (gap if cur else 0) + n
        cur.append(f)
    close()
    return packs, sorted(alone)


def pack_samples(pack: Pack, pcm: list[np.ndarray]) -> np.ndarray:
    """The pack's window: its files' samples (int16) at their offsets, silence between."""
    out = np.zeros(pack.samples, "<i2")
    for f, at, n in zip(pack.files, pack.offsets, pack.sizes):
        out[at:at + n] = pcm[f][:n]
    return out


def split_pack(pack: Pack, segments: list[dict[str, Any]], rate: int,
               gap: int) -> tuple[dict[int, list[dict[str, Any]]], list[int]]:
    """A pack's segments (times in the pack) -> ({file: its segments, times its own}, files to
    decode alone). A segment belongs to the file its middle falls in (a file's span reaching half
    a gap either side); one that also covers more than SPILL_SECONDS of another file's sound holds
    words of both, and both are decoded alone. (Timestamps are coarse: a segment may reach into
    the gaps.) Timestamps can also be wrong: on a pack of clips that say the same words, tiny.en
    gave a clip of 2.9 s the segment "get home to hide, please call me Mac when you get home to
    hide, please call me Mac when", its neighbours' words, inside its own span (five segments for
    seven clips, each holding about two clips' words); where a file is given more than
    MAX_WORDS_PER_SECOND words a second of its sound (whitespace-separated: scripts without
    spaces are not caught), every file of the pack is decoded alone."""
    spans = [((at - gap / 2) / rate, (at + n + gap / 2) / rate) for at, n in zip(pack.offsets, pack.sizes)]
    sound = [(at / rate, (at + n) / rate) for at, n in zip(pack.offsets, pack.sizes)]
    mine: dict[int, list[dict[str, Any]]] = {f: [] for f in pack.files}
    unsure: set[int] = set()
    for s in segments:
        mid = (s["start"] + s["end"]) / 2
        k = next((i for i, (_, b) in enumerate(spans) if mid < b), len(spans) - 1)
        others = [i for i, (a, b) in enumerate(sound)
                  if i != k and min(b, s["end"]) - max(a, s["start"]) > SPILL_SECONDS]
        if others:
            unsure.update(pack.files[i] for i in [k, *others])
            continue
        mine[pack.files[k]].append(_shifted(s, pack.offsets[k] / rate, pack.sizes[k] / rate))
    if any(sum(len(s["text"].split()) for s in mine[f]) > MAX_WORDS_PER_SECOND * max(n / rate, 1.0)
           for f, n in zip(pack.files, pack.sizes)):
        unsure.update(pack.files)       # the decoder lost the clips' places: no segment of the pack is sure
    return {f: segs for f, segs in mine.items() if f not in unsure}, sorted(unsure)


def _shifted(s: dict[str, Any], offset: float, length: float) -> dict[str, Any]:
    """A segment (and its words) moved to its file's time, inside [0, length]."""
    def at(t: float) -> float:
        return round(min(max(t - offset, 0.0), length), 3)

    out = {**s, "start": at(s["start"]), "end": at(s["end"])}
    if s.get("words") is not None:
        out["words"] = [{**w, "start": at(w["start"]), "end": at(w["end"])} for w in s["words"]]
    return out


def as_one_segment(segments: list[dict[str, Any]], length: float) -> list[dict[str, Any]]:
    """A file's segments as the one segment of a window decoded without timestamps."""
    if not segments:
        return []
    return [{"start": 0.0, "end": round(length, 3), "text": "".join(s["text"] for s in segments),
             "tokens": [t for s in segments for t in s["tokens"]]}]
