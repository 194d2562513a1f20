"""Input format `audio`: each object is one record (a wav, flac, mp3, ogg/opus or m4a file),
its content read whole, bounded; task transcribe decodes it and names it by its key."""

from __future__ import annotations

from typing import BinaryIO, Iterator

from batchinf.formats.record import InputRecord

MAX_AUDIO_BYTES = 2 << 30       # a larger audio object is an error row, never read into memory


def read_audio(fh: BinaryIO, uri: str) -> Iterator[InputRecord]:
    data = fh.read(MAX_AUDIO_BYTES + 1)
    if len(data) > MAX_AUDIO_BYTES:
        yield InputRecord(0, uri, None, "audio_too_large",
                          f"audio file {uri} is larger than {MAX_AUDIO_BYTES >> 20} MiB; cut it into shorter files "
                          "or re-encode it (e.g. flac or opus)")
        return
    yield InputRecord(0, uri, None, fields={"audio": data})
