"""Windows of at most `max_seconds`, cut at silence: an energy detector over 20 ms frames finds
the quietest stretch in the last part of each window (never inside a word when there is a pause
to cut at). Plain numpy, at plan time; a window is (start, end) in samples, and the windows of
a file cover it from its first sample to its last, in order."""

from __future__ import annotations

import numpy as np

FRAME_SECONDS = 0.02
MIN_WINDOW_FRACTION = 0.8     # cut in the last fifth of a window: windows stay long (fewer encoder passes), and
                              # measured on espeak speech, Whisper stops short of their end less often
SILENCE_DB = -45.0            # frames this far below the file's loudest are silence
SOUND_DB = -35.0              # frames within this of a window's loudest are sound (`sound_end`)


def frame_energy_db(samples: np.ndarray, frame: int) -> np.ndarray:
    """Mean power per frame, in dB ([n_frames])."""
    n = samples.size // frame
    if n == 0:
        return np.zeros(0, np.float32)
    power = np.square(samples[:n * frame].reshape(n, frame), dtype=np.float32).mean(axis=1)
    return (10.0 * np.log10(power + 1e-12)).astype(np.float32)


def plan_windows(samples: np.ndarray, sample_rate: int, max_seconds: float = 30.0) -> list[tuple[int, int]]:
    """(start, end) sample ranges covering `samples`, each at most max_seconds, cut at the middle of
    the longest quiet run (else the quietest frame) in the second half of each window."""
    n = samples.size
    limit = int(max_seconds * sample_rate)
    if n <= limit:
        return [(0, n)]
    frame = int(FRAME_SECONDS * sample_rate)
    db = frame_energy_db(samples, frame)
    quiet = db < (db.max() + SILENCE_DB if db.size else 0.0)
    out, start = [], 0
    while n - start > limit:
        lo, hi = (start + int(limit * MIN_WINDOW_FRACTION)) // frame, (start + limit) // frame
        out.append((start, cut := _cut(db, quiet, lo, hi, frame)))
        start = cut
    out.append((start, n))
    return out


def _cut(db: np.ndarray, quiet: np.ndarray, lo: int, hi: int, frame: int) -> int:
    """A sample position in frames [lo, hi): the middle of the longest quiet run, else the quietest frame."""
    q = quiet[lo:hi]
    if q.any():
        edges = np.diff(np.concatenate(([0], q.astype(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        k = int(np.argmax(ends - starts))
        return (lo + (starts[k] + ends[k]) // 2) * frame
    return (lo + int(np.argmin(db[lo:hi]))) * frame


def is_silent(samples: np.ndarray, sample_rate: int) -> bool:
    """Whether the file holds no sound worth a word: less than a second of frames above -50 dBFS."""
    db = frame_energy_db(samples, int(FRAME_SECONDS * sample_rate))
    return int((db > -50.0).sum()) * FRAME_SECONDS < 1.0


def sound_end(samples: np.ndarray, sample_rate: int) -> float:
    """Seconds from the start of `samples` to the end of their last frame of sound (within
    SOUND_DB of their loudest frame); 0.0 for silence. Where Whisper stops before this, words may
    be left unsaid; where it stops after, only quiet is left."""
    frame = int(FRAME_SECONDS * sample_rate)
    db = frame_energy_db(samples, frame)
    if not db.size or db.max() < -60.0:
        return 0.0
    loud = np.flatnonzero(db >= db.max() + SOUND_DB)
    return float(min(samples.size, (int(loud[-1]) + 1) * frame) / sample_rate)
