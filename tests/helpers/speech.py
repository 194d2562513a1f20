"""Speech test material: clips of known text synthesised with espeak-ng (several voices and
speeds; cached per machine under ~/.cache/batchinf-tests/speech, keyed by their text and voice),
bad audio files, and word error rate (WER) against the known text."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np

from tests.helpers.services import unavailable

CACHE = Path.home() / ".cache" / "batchinf-tests" / "speech"
VOICES = ("en-us", "en-gb", "en+f3", "en-us+m3")
SPEEDS = (150, 160, 175, 185)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back when you get home tonight.",
    "We will meet at the library on Monday morning.",
    "The weather today is cold and windy, so bring a warm coat.",
    "I would like a cup of coffee and a glass of water, please.",
    "She opened the window and looked at the garden below.",
    "Our team finished the project two weeks before the deadline.",
    "The children played football in the park until it got dark.",
    "He bought some fresh fruit and a little cheese at the market.",
    "The meeting has been moved to Thursday at three o'clock.",
    "Remember to turn off the lights before you leave the office.",
    "The doctor said that I should drink more water and sleep longer.",
    "My brother works at a small bank in the centre of the city.",
    "The new bridge across the river will open later this year.",
    "The old man sat by the fire and told us stories about the sea.",
    "Every file in the archive gets one transcript from the same model.",
    "The train was late because of the heavy snow in the mountains.",
    "Could you send me the final report before five o'clock?",
    "The museum is closed on Sundays, but it opens early on Saturday.",
    "We planted tomatoes, beans and potatoes in the garden last spring.",
    "The students asked many good questions after the lecture.",
    "Please write your name and address at the top of the page.",
    ("Last year we travelled by car from the coast to the mountains. The roads were quiet, the hotels "
     "were cheap, and every evening we walked down to the lake to watch the sun go down behind the hills."),
    ("The company will hire ten new engineers next month. They will work on the system that stores "
     "the records of every customer, and they will start in the main office near the station."),
]

PARAGRAPHS = [
    ("The history of the town goes back many hundreds of years. It started as a small village beside the "
     "river, where farmers brought their animals and their grain to sell at the weekly market. Over time "
     "the village grew. A church was built on the hill, then a school, and later a long stone bridge that "
     "carried the road to the north. In the last century the railway arrived, and with it came factories, "
     "shops and thousands of new people looking for work. Today the old market square is still the heart "
     "of the town. On Saturday mornings it is full of stalls selling fruit, vegetables, bread and flowers, "
     "and the cafes around it are busy from early in the morning until late at night. Visitors often "
     "walk along the river, cross the old bridge and climb the hill to the church, where they can see "
     "the whole valley spread out below them."),
    ("Good morning everyone, and thank you for coming to this meeting. I want to talk about the plans for "
     "the next quarter. First, we will finish moving our data to the new storage system. This work is "
     "almost done, and we expect to complete it by the end of the month. Second, we will hire three more "
     "people for the support team, because the number of calls has grown quickly this year. Third, we "
     "will review the budget with each department and look for ways to save money without cutting the "
     "services that our customers need. I know that many of you have questions, so please write them "
     "down, and we will answer them at the end. Finally, I would like to thank the whole team for the "
     "hard work over the last few months. The results have been very good, and we are in a strong "
     "position for the rest of the year."),
]


def espeak() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        unavailable("espeak-ng is not installed (apt-get install -y espeak-ng; .ci/run installs it)")
    return exe  # type: ignore[return-value]


def synth(text: str, voice: str = "en-us", speed: int = 160) -> bytes:
    """WAV bytes (22.05 kHz mono) of `text` spoken by espeak-ng, cached."""
    key = hashlib.sha256(f"{voice}|{speed}|{text}".encode()).hexdigest()[:20]
    path = CACHE / f"{key}.wav"
    if not path.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")    # pytest-xdist workers synthesise at collection, at once
        subprocess.run([espeak(), "-v", voice, "-s", str(speed), "-w", str(tmp), text], check=True,
                       capture_output=True, timeout=120)
        tmp.replace(path)
    return path.read_bytes()


def clips() -> list[tuple[str, str, bytes]]:
    """(name, text, wav) of every sentence, voices and speeds in turn."""
    return [(f"clip-{i:02d}.wav", s, synth(s, VOICES[i % len(VOICES)], SPEEDS[(i // 2) % len(SPEEDS)]))
            for i, s in enumerate(SENTENCES)]


def long_clip(k: int, repeat: int = 3) -> tuple[str, bytes]:
    """(text, wav) of paragraph k spoken `repeat` times (over 2.5 minutes for repeat 3)."""
    text = " ".join([PARAGRAPHS[k]] * repeat)
    return text, synth(text, VOICES[k % len(VOICES)], 150)


def wav_bytes(samples: np.ndarray, rate: int, channels: int = 1) -> bytes:
    """int16 samples ([n] or [n, channels]) as a WAV file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.asarray(samples, "<i2").tobytes())
    return buf.getvalue()


def wav_samples(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), "<i2"), w.getframerate()


_NUMBERS = {"0": "zero", "1": "one", "2": "two", "3": "three", "4": "four", "5": "five", "6": "six", "7": "seven",
            "8": "eight", "9": "nine", "10": "ten"}


def words(text: str) -> list[str]:
    """Lower case, punctuation dropped (hyphens split words), small numbers spelled out."""
    out = re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " ")).split()
    return [_NUMBERS.get(w, w) for w in (w.strip("'") for w in out) if w]


def wer(refs: list[str], hyps: list[str]) -> float:
    """Word error rate over a corpus: edit distance of words, summed, over the reference words."""
    errors = total = 0
    for ref, hyp in zip(refs, hyps):
        r, h = words(ref), words(hyp)
        d = list(range(len(h) + 1))
        for i, rw in enumerate(r, 1):
            prev, d[0] = d[0], i
            for j, hw in enumerate(h, 1):
                prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (rw != hw))
        errors += d[len(h)]
        total += len(r)
    return errors / max(total, 1)


def encode(samples: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    """int16 mono samples encoded with PyAV's FFmpeg (flac, ogg/opus, mp3, m4a/aac)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        out_rate = 48000 if codec == "libopus" else rate
        stream = out.add_stream(codec, rate=out_rate)
        stream.layout = "mono"
        resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=out_rate)
        frame = av.AudioFrame.from_ndarray(np.asarray(samples, np.int16).reshape(1, -1), format="s16", layout="mono")
        frame.rate = rate
        for f in resampler.resample(frame) + resampler.resample(None):
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def resampled(samples: np.ndarray, rate: int, to: int) -> np.ndarray:
    """int16 samples at another rate (linear interpolation: good enough for speech tests)."""
    n = int(len(samples) * to / rate)
    return np.interp(np.arange(n) * rate / to, np.arange(len(samples)), samples.astype(np.float64)).astype(np.int16)
