"""Speech helpers without a model: windows cut at silence (never longer than 30 s, covering the
file, cut inside the pauses), timestamp tokens parsed into absolute segments, windows stitched
monotonic, a WAV header's claimed duration read before decoding, and the log-mel features equal
to faster-whisper's (when it is installed)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from batchinf.runtime.speech.audio import wav_claimed_seconds
from batchinf.runtime.speech.features import FeatureSpec, log_mel
from batchinf.runtime.speech.segments import stitch, window_segments
from batchinf.runtime.speech.windows import plan_windows

RATE = 16000


def _speechlike(words: list[float], pause: float, seed: int = 0) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Bursts of noise ("words", seconds each) separated by silent pauses; their sample ranges."""
    rng = np.random.default_rng(seed)
    parts, spans, at = [], [], 0
    for w in words:
        n = int(w * RATE)
        parts += [0.3 * rng.standard_normal(n).astype(np.float32), np.zeros(int(pause * RATE), np.float32)]
        spans.append((at, at + n))
        at += n + int(pause * RATE)
    return np.concatenate(parts), spans


def test_windows_cover_the_file_and_cut_only_in_pauses() -> None:
    rng = np.random.default_rng(1)
    samples, words = _speechlike(list(rng.uniform(0.2, 1.5, 150)), 0.3)
    wins = plan_windows(samples, RATE, 30.0)
    assert wins[0][0] == 0 and wins[-1][1] == samples.size and len(wins) >= samples.size / (30 * RATE)
    assert all(a == b for (_, a), (b, _) in zip(wins, wins[1:]))           # contiguous, in order
    assert all(0 < b - a <= 30 * RATE for a, b in wins)
    for _, cut in wins[:-1]:
        assert not any(s < cut < e for s, e in words), cut                  # never inside a word
    assert plan_windows(samples[:RATE * 20], RATE) == [(0, RATE * 20)]      # a short file is one window


def test_window_without_pauses_is_still_cut_at_30_seconds() -> None:
    samples = 0.3 * np.random.default_rng(2).standard_normal(RATE * 75).astype(np.float32)
    wins = plan_windows(samples, RATE)
    assert all(b - a <= 30 * RATE for a, b in wins) and wins[-1][1] == samples.size


def test_timestamp_tokens_become_absolute_monotonic_segments() -> None:
    eot, tb = 50256, 50363
    def text(toks: list[int]) -> str:
        return "".join(f" w{t}" for t in toks)
    # <0.00> a b <1.00><1.00> c <2.40>  then trailing text without a closing timestamp
    tokens = [tb, 1, 2, tb + 50, tb + 50, 3, tb + 120, tb + 120, 4]
    segs = window_segments(tokens, eot, tb, 30.0, 40.0, text)
    assert [(s["start"], s["end"], s["text"]) for s in segs] == [(30.0, 31.0, " w1 w2"), (31.0, 32.4, " w3"),
                                                                (32.4, 40.0, " w4")]
    # a window's first segment may start before the last one ended: stitched times never go back
    text_, out = stitch([(0.0, [{"start": 0.0, "end": 31.0, "text": " a", "tokens": [1]}], {"avg_logprob": -0.1}),
                         (30.0, segs, {"avg_logprob": -0.2})])
    times = [x for s in out for x in (s["start"], s["end"])]
    assert times == sorted(times) and [s["id"] for s in out] == [0, 1, 2, 3] and out[1]["seek"] == 3000
    assert text_ == "a w1 w2 w3 w4"


def test_wav_header_claim_is_read_without_decoding() -> None:
    header = (b"RIFF" + struct.pack("<I", 0) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, RATE, RATE * 2, 2, 16)
              + b"data" + struct.pack("<I", RATE * 2 * 3 * 3600))
    assert wav_claimed_seconds(header) == pytest.approx(3 * 3600)
    assert wav_claimed_seconds(b"ID3\x03" + b"\0" * 100) is None


def test_log_mel_equals_faster_whisper() -> None:
    fe = pytest.importorskip("faster_whisper.feature_extractor")
    from faster_whisper.audio import pad_or_trim

    samples, _ = _speechlike([0.5, 1.0, 0.7], 0.2, seed=3)
    want = pad_or_trim(fe.FeatureExtractor()(samples)[..., :-1])
    np.testing.assert_allclose(log_mel(samples, FeatureSpec()), want, atol=1e-5)


def test_words_split_as_faster_whisper_splits_them() -> None:
    """Tokens grouped into words as faster-whisper groups them: a word at a leading space, trailing
    punctuation kept with its word (and counted apart, it takes no time), and text right after
    punctuation a word of its own that starts with it ("brother" "-in" "-work")."""
    from batchinf.runtime.speech.words import word_groups

    pieces = [" My", " brother", "-", "in", "-", "work", " such", " a", " bank", ",", " in", " the", " U", ".", "S", "."]
    groups = word_groups(list(range(len(pieces))), lambda ids: "".join(pieces[i] for i in ids))
    words = ["".join(pieces[i] for i in g) for g, _ in groups]
    assert words == [" My", " brother", "-in", "-work", " such", " a", " bank,", " in", " the", " U", ".S."]
    assert [core for _, core in groups] == [1, 1, 2, 2, 1, 1, 1, 1, 1, 1, 2]


def test_short_files_are_packed_in_order_up_to_one_window_with_gaps() -> None:
    from batchinf.runtime.speech.packing import pack_files

    window, gap = 30 * RATE, RATE
    sizes = [4 * RATE, 5 * RATE, 30 * RATE, 12 * RATE, 12 * RATE, 3 * RATE, 0, 2 * RATE]
    packable = [True, True, True, True, True, False, True, True]
    packs, alone = pack_files(sizes, packable, window, gap)
    assert [p.files for p in packs] == [(0, 1, 3), (4, 7)]
    assert packs[0].offsets == (0, 5 * RATE, 11 * RATE) and packs[0].samples <= window
    assert alone == [2, 5, 6]         # a full window, one not packable, an empty one
    assert sorted([f for p in packs for f in p.files] + alone) == list(range(len(sizes)))


def test_a_packs_segments_go_back_to_their_files_in_their_own_time() -> None:
    from batchinf.runtime.speech.packing import Pack, split_pack

    pack = Pack(files=(7, 9), offsets=(0, 5 * RATE), sizes=(4 * RATE, 3 * RATE))

    def seg(a: float, b: float, text: str) -> dict:
        return {"start": a, "end": b, "text": text, "tokens": [1], "words": [{"word": text, "start": a + 0.1,
                                                                               "end": b, "probability": 1.0}]}
    mine, unsure = split_pack(pack, [seg(0.0, 3.9, " one"), seg(5.2, 7.0, " two"), seg(7.0, 8.2, " three")],
                              RATE, RATE)
    assert unsure == []
    assert [s["text"] for s in mine[7]] == [" one"] and [s["text"] for s in mine[9]] == [" two", " three"]
    assert (mine[9][0]["start"], mine[9][0]["end"], mine[9][1]["end"]) == (0.2, 2.0, 3.0)   # clamped to 3 s
    assert mine[9][0]["words"][0]["start"] == 0.3
    # a segment running across the gap: both files are decoded alone
    mine, unsure = split_pack(pack, [seg(0.0, 6.5, " one two")], RATE, RATE)
    assert unsure == [7, 9] and mine == {}
    # timestamps that lost the clips (seen on tiny.en with a pack of clips saying one sentence):
    # a 4-second clip given 22 words, its neighbours' among them; no segment of the pack is trusted
    lost = " please call me back when you get home tonight" * 2 + " please call me back"
    mine, unsure = split_pack(pack, [seg(0.0, 4.0, lost), seg(5.2, 7.8, " please call me back")], RATE, RATE)
    assert unsure == [7, 9] and mine == {}
    # as many words as fast speech holds (4.5 a second) are one clip's
    mine, unsure = split_pack(pack, [seg(0.0, 4.0, " word" * 18), seg(5.2, 7.8, " two")], RATE, RATE)
    assert unsure == [] and len(mine[7][0]["text"].split()) == 18


def test_a_window_that_opened_a_segment_and_stopped_stopped_short() -> None:
    from batchinf.runtime.speech.segments import stopped_short

    eot, ts = 50256, 50363

    def t(sec: float) -> int:
        return ts + int(round(sec / 0.02))
    assert stopped_short([t(0), 10, t(3), t(3.5), eot], eot, ts, 20.0)              # a new segment opened
    assert not stopped_short([t(0), 10, t(3), t(3.5), eot], eot, ts, 3.4)          # ... at the audio's end
    assert not stopped_short([t(0), 10, 11, t(3), t(3), 12, t(5)], eot, ts, 20.0)  # ends closing a segment
    assert not stopped_short([t(0), 10, 11], eot, ts, 20.0)                        # text left open
    assert not stopped_short([10, 11, eot], eot, ts, 20.0)                         # no timestamps


def test_a_continuation_prompt_is_context_then_the_start_sequence_then_the_opened_timestamp() -> None:
    """What `WhisperEngine._continue` decodes from: the initial prompt and the window's tokens
    before its last as previous text (at most MAX_PROMPT of them, the latest), the start sequence
    (with language and task on a multilingual model), then the timestamp that opened a segment."""
    from batchinf.runtime.speech.whisper import MAX_PROMPT, Decoding, WhisperEngine

    class Vocab:
        def token_to_id(self, name: str) -> int:
            return {"<|de|>": 50261}[name]

    specials = {"<|startofprev|>": 50361, "<|startoftranscript|>": 50258, "<|transcribe|>": 50359,
                "<|translate|>": 50358}
    engine = WhisperEngine.__new__(WhisperEngine)
    engine.specials, engine.tokenizer, engine.multilingual = specials, Vocab(), True
    tokens = [50365, 11, 12, 50400, 50410]          # <|0.04|> text <|0.74|> <|0.94|>: opened and stopped
    got = engine.continuation_prompt(Decoding(initial_prompt=[7, 8], task="translate"), "de", tokens)
    assert got == [50361, 7, 8, 50365, 11, 12, 50400, 50258, 50261, 50358, 50410]
    long = list(range(300)) + [50410]
    got = engine.continuation_prompt(Decoding(), "de", long)
    assert got[0] == 50361 and got[1:1 + MAX_PROMPT] == list(range(300 - MAX_PROMPT, 300))
    engine.multilingual = False
    assert engine.continuation_prompt(Decoding(), None, tokens)[-2:] == [50258, 50410]
