"""Audio decoding, bounded: any container and codec FFmpeg (PyAV) reads -> mono float32 at the
model's sample rate. The duration a file's header claims is checked against the operator's limit
before a sample is decoded, and decoding stops at the limit whatever the header said, so a tiny
file that claims (or holds) hours costs nothing. Channels are downmixed, any sample rate is
resampled. What cannot be decoded is an `AudioProblem` with an error code and the fix."""

from __future__ import annotations

import io
import struct
import time
from dataclasses import dataclass

import numpy as np

from batchinf.runtime.speech import need

MAX_AUDIO_BYTES = 2 << 30           # an audio object larger than this is not read
DECODE_SECONDS_PER_AUDIO_HOUR = 600  # wall-clock budget of decoding, per hour of audio allowed (and at least 30 s)


class AudioProblem(Exception):
    """An audio file that cannot be transcribed: `code` for the error row, the text says why and the fix."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Probe:
    """What a file's header says, before decoding."""
    codec: str
    sample_rate: int
    channels: int
    seconds: float | None      # None: the header does not say


def _open(data: bytes):  # type: ignore[no-untyped-def]
    av = need("av")

    if not data:
        raise AudioProblem("empty_audio", "is empty (0 bytes); upload the audio again")
    # a WAV's header says all a decoder needs: FFmpeg need not read packets to find its stream's
    # parameters (7 ms a file, most of planning a corpus of short clips); other formats it probes
    wav = data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore",
                            **({"options": {"probesize": "32"}} if wav else {}))
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise AudioProblem("not_audio", f"is not an audio file FFmpeg can read ({_why(exc)}); "
                                        "convert it to wav, flac, mp3, ogg/opus or m4a") from None
    if not container.streams.audio:
        container.close()
        raise AudioProblem("not_audio", "has no audio stream; give an audio file (wav, flac, mp3, ogg/opus, m4a)")
    return container


def _why(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def probe(data: bytes) -> Probe:
    """The header's codec, rate, channels and duration (nothing is decoded)."""
    container = _open(data)
    try:
        return _probe(container, data)
    finally:
        container.close()


def _probe(container, data: bytes) -> Probe:  # type: ignore[no-untyped-def]
    stream = container.streams.audio[0]
    seconds = wav_claimed_seconds(data)     # FFmpeg goes by a WAV's size; its header may claim more
    if seconds is None and stream.duration is not None and stream.time_base is not None:
        seconds = float(stream.duration * stream.time_base)
    elif seconds is None and container.duration is not None:
        seconds = container.duration / 1_000_000
    ctx = stream.codec_context
    return Probe(ctx.name if ctx is not None else "?", int(stream.rate or 0), int(stream.channels or 0), seconds)


def wav_claimed_seconds(data: bytes) -> float | None:
    """The duration a RIFF/WAVE header's data chunk claims (None: not a WAV, or it does not say)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos, byte_rate = 12, 0
    while pos + 8 <= min(len(data), 1 << 20):
        kind, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if kind == b"fmt " and pos + 16 <= len(data):
            byte_rate = struct.unpack_from("<I", data, pos + 16)[0]
        elif kind == b"data":
            return size / byte_rate if byte_rate and size != 0xFFFFFFFF else None
        pos += 8 + size + (size & 1)
    return None


def decode(data: bytes, sample_rate: int, max_seconds: float) -> tuple[np.ndarray, Probe]:
    """Mono float32 samples at `sample_rate` ([n], in [-1, 1)) and the probe: `decode_s16`'s."""
    pcm, info = decode_s16(data, sample_rate, max_seconds)
    return pcm.astype(np.float32) / 32768.0, info


def decode_s16(data: bytes, sample_rate: int, max_seconds: float) -> tuple[np.ndarray, Probe]:
    """Mono 16-bit samples at `sample_rate` ([n] int16) and the probe. Refuses a header that claims
    more than `max_seconds`, and stops decoding at `max_seconds` (audio_too_long) whatever it claims."""
    av = need("av")

    container = _open(data)
    try:
        info = _probe(container, data)
        if info.seconds is not None and info.seconds > max_seconds:
            raise AudioProblem("audio_too_long", f"is {info.seconds:.0f} s long by its header, over the limit of "
                                                 f"{max_seconds:g} s (BATCHINF_MAX_AUDIO_SECONDS); cut it into "
                                                 "shorter files or ask the operator to raise the limit")
        limit = int(max_seconds * sample_rate) + 1
        deadline = time.monotonic() + max(30.0, DECODE_SECONDS_PER_AUDIO_HOUR * max_seconds / 3600)
        resampler = av.AudioResampler(format="s16", layout="mono", rate=sample_rate)
        pieces: list[np.ndarray] = []
        n = 0
        stream = container.streams.audio[0]
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    pieces.append(out.to_ndarray().reshape(-1))
                    n += pieces[-1].size
                if n > limit:
                    raise AudioProblem("audio_too_long", f"decodes to more than {max_seconds:g} s, over the limit "
                                                         "(BATCHINF_MAX_AUDIO_SECONDS); cut it into shorter files")
                if time.monotonic() > deadline:
                    raise AudioProblem("audio_decode_timeout", "took too long to decode; re-encode it (e.g. "
                                                               "`ffmpeg -i IN -ar 16000 -ac 1 OUT.flac`)")
            for out in resampler.resample(None):
                pieces.append(out.to_ndarray().reshape(-1))
        except av.error.FFmpegError as exc:
            if not pieces:
                raise AudioProblem("bad_audio", f"cannot be decoded ({_why(exc)}); the file is damaged or "
                                                f"its codec {info.codec} is not supported: re-encode it") from None
            raise AudioProblem("truncated_audio", f"breaks off after {n / sample_rate:.1f} s ({_why(exc)}); "
                                                  "the file is truncated or damaged: upload it again") from None
    finally:
        container.close()
    pcm = np.concatenate(pieces).astype(np.int16, copy=False) if pieces else np.zeros(0, np.int16)
    if pcm.size == 0:
        raise AudioProblem("bad_audio", f"holds no audio samples (codec {info.codec}); the file is damaged "
                                        "or truncated: upload it again")
    if info.seconds is not None and pcm.size < 0.9 * info.seconds * sample_rate - sample_rate:
        raise AudioProblem("truncated_audio", f"decodes to {pcm.size / sample_rate:.1f} s but its header "
                                              f"says {info.seconds:.1f} s; the file is truncated: upload it again")
    return np.ascontiguousarray(pcm), info
