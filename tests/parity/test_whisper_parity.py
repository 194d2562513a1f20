"""The speech engine against transformers: Whisper tiny.en's CTranslate2 weights read into
WhisperForConditionalGeneration (tests/helpers/whisper_reference.py; fused QKV split back), the
bundle's engine (WhisperEngine over the pinned files, float32 compute) gives identical greedy
tokens on the fixture clips, with and without timestamps, and encoder outputs within 2e-4 of the
reference (absolute or relative; float16 weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from batchinf.bundles import import_bundle, local_dir
from batchinf.runtime.bundle import read_meta
from batchinf.runtime.speech.audio import decode
from batchinf.runtime.speech.features import FeatureSpec, batch_features
from batchinf.runtime.speech.whisper import Decoding, WhisperEngine
from tests.helpers.real_models import whisper_tiny_en_dir
from tests.helpers.speech import SENTENCES, synth
from tests.helpers.whisper_reference import greedy, suppress_ids, whisper_from_ct2

pytestmark = [pytest.mark.parity, pytest.mark.slow]


@pytest.fixture(scope="module")
def reference() -> object:
    return whisper_from_ct2(whisper_tiny_en_dir())


def test_engine_matches_transformers_whisper(bi_home: Path, reference: object) -> None:
    root = local_dir(import_bundle(whisper_tiny_en_dir(), "tiny-en").digest)
    meta = read_meta(root)
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
    engine = WhisperEngine(root, {**meta, "compute_type": {"cpu": "float32"}}, tokenizer, "cpu", threads=2)
    clips = [decode((root / meta["fixtures"][0]["clip"]).read_bytes(), 16000, 60)[0]]
    clips += [decode(synth(SENTENCES[i], voice, 170), 16000, 60)[0] for i, voice in ((3, "en-gb"), (10, "en+f3"))]
    feats = batch_features(clips, FeatureSpec())

    import ctranslate2

    ours = np.array(engine.model.encode(ctranslate2.StorageView.from_array(feats)))
    with torch.no_grad():
        want = reference.model.encoder(torch.from_numpy(feats)).last_hidden_state.numpy()   # type: ignore[attr-defined]
    assert ours.shape == want.shape == (3, 1500, 384)
    # within 2e-4 of the reference, absolute or relative (the hidden states reach |x| ~ 10; float32
    # reductions in another order differ by ~1e-5 relative there)
    np.testing.assert_allclose(ours, want, rtol=2e-4, atol=2e-4)
    assert np.abs(ours - want).mean() < 1e-5

    sup, sup_begin = suppress_ids(whisper_tiny_en_dir())
    eot, sot, no_ts = (meta["special_tokens"][k] for k in ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"))
    for timestamps in (True, False):
        results, _ = engine.generate(feats, Decoding(timestamps=timestamps, temperatures=(0.0,), beam_size=1))
        for i, r in enumerate(results):
            prompt = [sot] if timestamps else [sot, no_ts]
            ref = greedy(reference, feats[i], prompt, sup, sup_begin, eot, no_timestamps=no_ts, timestamps=timestamps)
            assert r.tokens == ref, (i, timestamps, engine.decode_text(r.tokens), engine.decode_text(ref))
            assert len(r.tokens) > 5


def test_a_transformers_whisper_directory_is_converted_at_import(bi_home: Path, reference: object,
                                                                 tmp_path: Path) -> None:
    """The reference model saved by transformers (safetensors, float16) imports through
    CTranslate2's converter; the converted files are the bundle's, its conversion is pinned, and it
    transcribes the fixture clip to the very tokens of the CTranslate2 directory's bundle."""
    import shutil

    hf = tmp_path / "hf-whisper"
    reference.half().save_pretrained(hf, safe_serialization=True)      # type: ignore[attr-defined]
    reference.float()                                                   # type: ignore[attr-defined]
    shutil.copyfile(whisper_tiny_en_dir() / "tokenizer.json", hf / "tokenizer.json")
    converted = local_dir(import_bundle(hf, "tiny-en-hf").digest)
    direct = local_dir(import_bundle(whisper_tiny_en_dir(), "tiny-en").digest)
    meta, want = read_meta(converted), read_meta(direct)
    assert meta["converted_from"]["from"] == "transformers"
    assert set(meta["converted_from"]["source_files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert "conversion.json" in meta["files"] and "model.ct2" in meta["files"] and meta["dtype"] == "float16"
    assert meta["fixtures"][0]["tokens"] == want["fixtures"][0]["tokens"]
    (hf / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(Exception, match="refusing pickle"):
        import_bundle(hf, "pickled")


def test_word_timestamps_match_faster_whisper(bi_home: Path) -> None:
    """timestamps: word gives the words faster-whisper's word_timestamps gives, on the same clips,
    with the same start times and (segment-end clamping aside) the same end times."""
    import io

    fw = pytest.importorskip("faster_whisper")
    from batchinf.bundles import open_runtime
    from batchinf.tasks.transcribe import TranscribeOptions, transcribe_rows

    rt = open_runtime(import_bundle(whisper_tiny_en_dir(), "tiny-en").digest)
    wavs = [synth(SENTENCES[i], voice, 160) for i, voice in ((3, "en-us"), (22, "en-gb"), (12, "en+f3"))]
    pcm = [np.round(decode(w, 16000, 100)[0] * 32768).astype("<i2") for w in wavs]
    out = transcribe_rows(rt, TranscribeOptions(timestamps="word"), [p.tobytes() for p in pcm],
                          [[(0, p.size)] for p in pcm], ["a", "b", "c"], lambda: None)
    model = fw.WhisperModel(str(whisper_tiny_en_dir()), device="cpu", compute_type="int8", cpu_threads=1)
    ends = same_end = 0
    for i, w in enumerate(wavs):
        ours = [x for s in out.results[i]["segments"] for x in s["words"]]
        segments, _ = model.transcribe(io.BytesIO(w), beam_size=5, word_timestamps=True, condition_on_previous_text=False)
        ref = [x for s in segments for x in s.words]
        assert [x["word"] for x in ours] == [x.word for x in ref]
        assert [x["start"] for x in ours] == pytest.approx([x.start for x in ref], abs=0.02)
        ends += len(ref)
        same_end += sum(abs(a["end"] - b.end) <= 0.02 for a, b in zip(ours, ref))
        for s in out.results[i]["segments"]:
            assert all(s["start"] <= x["start"] <= x["end"] <= s["end"] for x in s["words"])
    assert same_end >= 0.9 * ends


def test_a_window_that_stopped_short_is_decoded_on_from_its_last_timestamp(bi_home: Path) -> None:
    """The first window of a long file (cut at a pause, as planning cuts it) ends its first pass by
    opening a segment seconds before its sound ends. The engine decodes it on, once, from that
    timestamp, its first pass as context: the window's tokens grow from the first pass's and say
    the last sentence's end; a window that closed its last segment is left as it was."""
    from batchinf.runtime.speech.segments import stopped_short
    from batchinf.runtime.speech.windows import plan_windows, sound_end
    from tests.helpers.speech import long_clip, words

    root = local_dir(import_bundle(whisper_tiny_en_dir(), "tiny-en").digest)
    meta = read_meta(root)
    import tokenizers

    engine = WhisperEngine(root, meta, tokenizers.Tokenizer.from_file(str(root / "tokenizer.json")), "cpu", threads=2)
    samples = decode(long_clip(0, 1)[1], 16000, 600)[0]
    windows = plan_windows(samples, 16000)
    clips = [samples[a:b] for a, b in windows[:2]]
    feats = batch_features(clips, FeatureSpec())
    d = Decoding(beam_size=5)
    first, _ = engine.generate(feats, d)            # no sound ends given: nothing is continued
    ends = [sound_end(c, 16000) for c in clips]
    short = [stopped_short(r.tokens, engine.eot, engine.timestamp_begin, e - 0.3) for r, e in zip(first, ends)]
    assert short == [True, False], [engine.decode_text(r.tokens)[-60:] for r in first]

    prompt = engine.continuation_prompt(d, None, first[0].tokens)
    sot = meta["special_tokens"]["<|startoftranscript|>"]
    assert prompt == [meta["special_tokens"]["<|startofprev|>"], *first[0].tokens[:-1], sot, first[0].tokens[-1]]

    got, _ = engine.generate(feats, d, ends)
    assert got[1].tokens == first[1].tokens
    assert got[0].tokens[:len(first[0].tokens)] == first[0].tokens and len(got[0].tokens) > len(first[0].tokens)
    added = words(engine.decode_text(got[0].tokens[len(first[0].tokens):]))
    assert added[-3:] == ["looking", "for", "work"], added
