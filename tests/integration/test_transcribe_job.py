"""Task transcribe end to end on the embedded default with the real Whisper tiny.en (CTranslate2,
int8): bundle import pins the directory (model.bin renamed model.ct2, fixture clip and its tokens
checked at load); audio objects of every container in, one transcript row per file; WER on
espeak-ng clips of known text against faster-whisper (the reference) run on the same files; bad
audio as error rows naming the file beside good ones."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchinf.bundles import import_bundle, local_dir
from batchinf.controller import drive
from batchinf.config import settings
from batchinf.errors import BundleError
from batchinf.ledger.states import JobStatus
from batchinf.manifest import parse_manifest
from batchinf.scopes import Caller
from batchinf.submit import submit
from tests.helpers.real_models import whisper_tiny_en_dir
from tests.helpers.speech import SENTENCES, clips, encode, long_clip, resampled, synth, wav_bytes, wav_samples, wer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run(tmp_path: Path, files: dict[str, bytes], name: str, **options: object) -> tuple[list[dict], list[dict], dict]:
    inp = tmp_path / f"in-{name}"
    inp.mkdir()
    for key, data in files.items():
        (inp / key).parent.mkdir(parents=True, exist_ok=True)
        (inp / key).write_bytes(data)
    out = tmp_path / f"out-{name}"
    m = {"name": name, "task": "transcribe", "bundle": "tiny-en@prod", "output": {"uri": str(out)},
         "input": {"uri": str(inp) + "/", "format": "audio"}, "shards": {"max_records": 8}, "options": options}
    job_id, _ = submit(parse_manifest(m), Caller("default", operator=True))
    assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
    res = pq.read_table(out, ignore_prefixes=["_", "errors", "srt", "vtt"]).to_pylist()
    errs = pq.read_table(out / "errors").to_pylist() if (out / "errors").exists() else []
    return res, errs, json.loads((out / "_MANIFEST.json").read_text())


@pytest.fixture
def tiny_en(bi_home: Path) -> str:
    return import_bundle(whisper_tiny_en_dir(), "tiny-en", alias="prod").digest


def test_bundle_import_pins_the_ctranslate2_directory(tiny_en: str, tmp_path: Path) -> None:
    root = local_dir(tiny_en)
    meta = json.loads((root / "bundle.json").read_text())
    assert meta["task"] == "transcribe" and meta["backend"] == "ctranslate2" and meta["dtype"] == "float16"
    assert meta["features"] == {"sample_rate": 16000, "n_mels": 80, "hop": 160, "n_fft": 400, "chunk_seconds": 30}
    assert meta["compute_type"]["cpu"] == "int8" and meta["multilingual"] is False
    assert meta["special_tokens"]["<|startoftranscript|>"] == 50257 and meta["special_tokens"]["<|notimestamps|>"] == 50362
    assert set(meta["files"]) == {"model.ct2", "config.json", "tokenizer.json", "vocabulary.txt", "fixtures/clip-0.wav"}
    assert not list(root.rglob("*.bin"))
    fx = meta["fixtures"][0]
    assert fx["tokens"][0] >= 50363 and "file" in fx["text"].lower()     # a timestamp, then speech
    # a bundle whose fixture no longer matches is refused, naming the fixture and the difference
    bad = tmp_path / "tampered"
    shutil.copytree(root, bad)
    meta["fixtures"][0]["tokens"] = fx["tokens"][:3] + [fx["tokens"][3] + 1] + fx["tokens"][4:]
    from batchinf.tasks.speech_bundle import verify_speech_tokens
    from batchinf.runtime.speech.runtime import SpeechRuntime

    rt = SpeechRuntime(bad, meta)
    rt.load_model(threads=1)
    with pytest.raises(BundleError, match=r"model fixture 0 .*fixtures/clip-0.wav.*first difference at position 3"):
        verify_speech_tokens(rt)
    # a model.bin that is not CTranslate2's (a renamed pickle) is refused by its header
    fake = tmp_path / "fake"
    shutil.copytree(whisper_tiny_en_dir(), fake, ignore=shutil.ignore_patterns("model.bin"))
    (fake / "model.bin").write_bytes(b"\x80\x04\x95" + b"\0" * 64)
    with pytest.raises(BundleError, match="not a CTranslate2 Whisper model"):
        import_bundle(fake, "fake")


def test_wer_on_espeak_clips_matches_faster_whisper(tiny_en: str, tmp_path: Path) -> None:
    material = clips()
    assert len(material) >= 20
    files = {name: wav for name, _, wav in material}
    res, errs, manifest = _run(tmp_path, files, "wer", max_batch_windows=8)
    assert errs == [] and len(res) == len(material)
    got = {r["record_id"]: r for r in res}
    refs = [text for _, text, _ in material]
    ours = [got[name]["text"] for name, _, _ in material]
    score = wer(refs, ours)
    for r in res:
        wav, rate = wav_samples(files[r["record_id"]])
        assert r["duration_seconds"] == pytest.approx(len(wav) / rate, abs=0.01) and r["language"] == "en"
        assert 2.0 <= r["duration_seconds"] <= 30.0
        ends = [0.0] + [x for s in r["segments"] for x in (s["start"], s["end"])]
        assert ends == sorted(ends) and ends[-1] <= r["duration_seconds"] + 0.02
        assert r["text"] == "".join(s["text"] for s in r["segments"]).strip()
        # below the no-speech threshold (0.6): a packed clip carries its shared window's probability
        assert all(s["no_speech_prob"] < 0.6 and s["avg_logprob"] < 0 for s in r["segments"])
    assert manifest["precision"].startswith("int8 on CPU") and manifest["implementation"]["name"] == "ctranslate2"
    assert manifest["counts"]["audio_seconds"] == pytest.approx(sum(r["duration_seconds"] for r in res), abs=0.01)
    fw = pytest.importorskip("faster_whisper")
    model = fw.WhisperModel(str(whisper_tiny_en_dir()), device="cpu", compute_type="int8", cpu_threads=1)
    ref_text = []
    for name, _, _ in material:
        segments, _ = model.transcribe(str(tmp_path / "in-wer" / name), beam_size=5, vad_filter=False,
                                       condition_on_previous_text=False)
        ref_text.append("".join(s.text for s in segments).strip())
    reference = wer(refs, ref_text)
    # each clip in windows of its own (pack: false): the same decoder on the same features as faster-whisper
    alone, _, alone_manifest = _run(tmp_path, files, "wer-alone", max_batch_windows=8, pack=False)
    alone_text = {r["record_id"]: r["text"] for r in alone}
    print(f"WER batchinf {score:.3f} packed, {wer(refs, [alone_text[n] for n, _, _ in material]):.3f} alone; "
          f"faster-whisper {reference:.3f}; padded seconds {manifest['tokens']['padded']} packed, "
          f"{alone_manifest['tokens']['padded']} alone")
    assert score <= 0.08 and score <= reference + 0.01
    assert sum(alone_text[n] == b for (n, _, _), b in zip(material, ref_text)) >= len(material) - 2
    # packed: several clips per 30-second window, so a third of the windows or fewer
    assert manifest["tokens"]["padded"] * 3 <= alone_manifest["tokens"]["padded"]


def _wav_header(rate: int, data_bytes: int, channels: int = 1) -> bytes:
    return (b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, channels, rate,
            rate * 2 * channels, 2 * channels, 16) + b"data" + struct.pack("<I", data_bytes))


def test_bad_audio_is_an_error_row_beside_good_files(tiny_en: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHINF_MAX_AUDIO_SECONDS", "120")
    speech, rate = wav_samples(synth(SENTENCES[1], "en-us", 160))
    good = wav_bytes(speech, rate)
    stereo = np.stack([speech, (speech // 2)], axis=1)               # two channels: downmixed
    rng = np.random.default_rng(0)
    files = {
        "good.wav": good,
        "formats/flac.flac": encode(speech, rate, "flac", "flac"),
        "formats/opus.ogg": encode(speech, rate, "ogg", "libopus"),
        "formats/mp3.mp3": encode(speech, rate, "mp3", "libmp3lame"),
        "formats/aac.m4a": encode(speech, rate, "ipod", "aac"),
        "stereo-44k.wav": wav_bytes(resampled(stereo[:, 0], rate, 44100).repeat(2).reshape(-1, 2), 44100, channels=2),
        "odd-rate-11025.wav": wav_bytes(resampled(speech, rate, 11025), 11025),
        "empty.wav": b"",
        "notes.wav": b"These are meeting notes, not audio.\n" * 20,
        "truncated.wav": good[: len(good) // 3],
        "noise.wav": _wav_header(16000, 32000 * 4) + rng.integers(-20000, 20000, 16000 * 4, dtype=np.int16).tobytes(),
        "claims-hours.wav": _wav_header(16000, 16000 * 2 * 3 * 3600) + speech[:1600].tobytes(),
        "too-long.wav": wav_bytes(np.tile(speech, int(130 * rate / len(speech)) + 1), rate),
    }
    settings.cache_clear()          # read once per process: the driver plans here
    try:
        res, errs, manifest = _run(tmp_path, files, "bad")
    finally:
        monkeypatch.delenv("BATCHINF_MAX_AUDIO_SECONDS")
        settings.cache_clear()
    codes = {e["record_id"]: e["error"] for e in errs}
    assert codes == {"empty.wav": "empty_audio", "notes.wav": "not_audio", "truncated.wav": "truncated_audio",
                     "noise.wav": "no_speech_found", "claims-hours.wav": "audio_too_long", "too-long.wav": "audio_too_long"}
    for e in errs:
        assert e["record_id"] in e["message"] and "tmp" in e["message"]      # names the file ...
    msgs = {e["record_id"]: e["message"] for e in errs}
    assert "BATCHINF_MAX_AUDIO_SECONDS" in msgs["claims-hours.wav"] and "by its header" in msgs["claims-hours.wav"]
    assert "upload it again" in msgs["truncated.wav"] and "convert it" in msgs["notes.wav"]    # ... and the fix
    want = [w for w in SENTENCES[1].lower().rstrip(".").split()]
    texts = {r["record_id"]: r["text"] for r in res}
    assert set(texts) == set(files) - set(codes)
    # the WAV gives the sentence (tiny.en may mishear a word or three of espeak-ng's voice, which
    # differs by version), and every other container, layout and rate gives what the WAV gave: a
    # broken decode gives noise (WER near 1)
    assert wer([SENTENCES[1]], [texts["good.wav"]]) <= 0.4, (texts["good.wav"], want)
    for key, text in texts.items():
        assert wer([texts["good.wav"]], [text]) <= 0.25, (key, text, texts["good.wav"])
    assert manifest["counts"]["records_failed"] == len(codes)


def test_long_files_are_windowed_at_silence_and_stitched(tiny_en: str, tmp_path: Path) -> None:
    material = [long_clip(0), long_clip(1)]
    files = {f"long-{k}.wav": wav for k, (_, wav) in enumerate(material)}
    res, errs, _ = _run(tmp_path, files, "long", max_batch_windows=4)
    assert errs == []
    got = {r["record_id"]: r for r in res}
    refs, hyps = [t for t, _ in material], [got[f"long-{k}.wav"]["text"] for k in range(2)]
    score = wer(refs, hyps)
    print(f"WER on two long files: {score:.3f}")
    assert score <= 0.08
    for r in res:
        assert r["duration_seconds"] >= 120
        seeks = sorted({s["seek"] for s in r["segments"]})
        assert len(seeks) >= 5 and seeks[0] == 0                 # segments from every window, in order
        times = [x for s in r["segments"] for x in (s["start"], s["end"])]
        assert times == sorted(times) and times[-1] <= r["duration_seconds"] + 0.02
        assert times[-1] >= r["duration_seconds"] - 5            # transcribed to the end
        assert [s["id"] for s in r["segments"]] == list(range(len(r["segments"])))


def test_translate_on_an_english_only_bundle_is_refused(tiny_en: str, tmp_path: Path) -> None:
    from batchinf.ledger.status import status

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.wav").write_bytes(synth(SENTENCES[0]))
    m = {"name": "translate", "task": "transcribe", "bundle": "tiny-en@prod", "output": {"uri": str(tmp_path / "out")},
         "input": {"uri": str(tmp_path / "in") + "/", "format": "audio"}, "options": {"task": "translate"}}
    job_id, _ = submit(parse_manifest(m), Caller("default", operator=True))
    assert drive(job_id, workers=1, threads=1) == JobStatus.FAILED
    assert "English-only" in status(job_id)["error"] and "multilingual" in status(job_id)["error"]
    with pytest.raises(Exception, match="language code"):
        parse_manifest({**m, "options": {"language": "english!"}})


def test_srt_and_vtt_files_are_listed_in_the_manifest(tiny_en: str, tmp_path: Path) -> None:
    from batchinf.verify import verify_output

    files = {"talks/a.wav": synth(SENTENCES[4], "en-us", 160), "b.wav": synth(SENTENCES[7], "en-gb", 170)}
    res, errs, manifest = _run(tmp_path, files, "subs", formats=["srt", "vtt"])
    assert errs == [] and len(res) == 2
    out = tmp_path / "out-subs"
    subs = {p["key"]: p for p in manifest["parts"] if p["kind"] in ("srt", "vtt")}
    assert set(subs) == {"srt/talks/a.wav.srt", "vtt/talks/a.wav.vtt", "srt/b.wav.srt", "vtt/b.wav.vtt"}
    row = next(r for r in res if r["record_id"] == "talks/a.wav")
    srt = (out / "srt/talks/a.wav.srt").read_text()
    assert srt.startswith("1\n00:00:00,000 --> ") and row["segments"][0]["text"].strip() in srt
    assert (out / "vtt/talks/a.wav.vtt").read_text().startswith("WEBVTT\n\n00:00:00.000 --> ")
    assert verify_output(str(out))["ok"]
    # the same files transcribed again, as another job (its input prefix elsewhere): the same rows,
    # the very same subtitle bytes
    res2, _, again = _run(tmp_path, files, "subs-again", formats=["srt", "vtt"])
    drop = lambda rows: sorted(({k: v for k, v in r.items() if k != "source"} for r in rows),  # noqa: E731
                               key=lambda r: r["record_id"])
    assert drop(res2) == drop(res)
    assert sorted((p["key"], p["sha256"]) for p in again["parts"] if p["kind"] in ("srt", "vtt")) == \
        sorted((p["key"], p["sha256"]) for p in manifest["parts"] if p["kind"] in ("srt", "vtt"))
    (out / "srt/b.wav.srt").write_text("tampered")
    with pytest.raises(Exception, match="srt/b.wav.srt: sha256"):
        verify_output(str(out))


def test_records_naming_audio_by_uri_or_bytes(tiny_en: str, tmp_path: Path) -> None:
    import pyarrow as pa

    objects = tmp_path / "objects"
    objects.mkdir()
    (objects / "a.wav").write_bytes(synth(SENTENCES[1], "en-us", 160))
    lines = [{"id": "by-uri", "audio": f"file://{objects}/a.wav"}, {"id": "gone", "audio": f"file://{objects}/no.wav"},
             {"id": "none"}]
    inp = tmp_path / "in-records"
    inp.mkdir()
    (inp / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    pq.write_table(pa.table({"id": ["by-bytes"], "sound": [synth(SENTENCES[2], "en-gb", 170)]}), inp / "b.parquet")
    outs = {}
    for fmt, field in (("jsonl", None), ("parquet", "sound")):
        out = tmp_path / f"out-{fmt}"
        m = {"name": f"records-{fmt}", "task": "transcribe", "bundle": "tiny-en@prod", "output": {"uri": str(out)},
             "input": {"uri": str(inp / f"{'a' if fmt == 'jsonl' else 'b'}.{fmt}"), "format": fmt,
                       **({"audio_field": field} if field else {})}}
        job_id, _ = submit(parse_manifest(m), Caller("default", operator=True))
        assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
        res = pq.read_table(out, ignore_prefixes=["_", "errors"]).to_pylist()
        errs = pq.read_table(out / "errors").to_pylist() if (out / "errors").exists() else []
        outs[fmt] = ({r["record_id"]: r["text"] for r in res}, {e["record_id"]: e["error"] for e in errs})
    assert outs["jsonl"][1] == {"gone": "audio_unreachable", "none": "missing_audio"}
    assert wer([SENTENCES[1]], [outs["jsonl"][0]["by-uri"]]) <= 0.2
    assert outs["parquet"][1] == {} and wer([SENTENCES[2]], [outs["parquet"][0]["by-bytes"]]) <= 0.2


def test_records_set_their_own_options_and_progress_counts_audio_seconds(tiny_en: str, tmp_path: Path) -> None:
    """Each record's own options (fields, or an `options` object) decode it; wrong ones are
    invalid_options error rows naming the field; the status counts the job's audio seconds."""
    from batchinf.ledger.status import status

    objects = tmp_path / "objects"
    objects.mkdir()
    for k in range(4):
        (objects / f"{k}.wav").write_bytes(synth(SENTENCES[k], ("en-us", "en-gb")[k % 2], 160 + 5 * k))
    uri = lambda k: f"file://{objects}/{k}.wav"  # noqa: E731
    lines = [{"id": "plain", "audio": uri(0)},
             {"id": "words", "audio": uri(1), "options": {"timestamps": "word", "beam_size": 1}},
             {"id": "flat", "audio": uri(2), "timestamps": "none", "prompt": "Quick brown foxes."},
             {"id": "warm", "audio": uri(3), "temperature": 0.2, "language": "en", "task": "transcribe"},
             {"id": "german", "audio": uri(0), "language": "de"},
             {"id": "packless", "audio": uri(0), "options": {"pack": False}},
             {"id": "hot", "audio": uri(0), "temperature": 3},
             {"id": "listed", "audio": uri(0), "options": ["timestamps"]}]
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    m = {"name": "own-options", "task": "transcribe", "bundle": "tiny-en@prod", "output": {"uri": str(out)},
         "input": {"uri": str(inp / "a.jsonl"), "format": "jsonl"}}
    job_id, _ = submit(parse_manifest(m), Caller("default", operator=True))
    assert drive(job_id, workers=1, threads=1) == JobStatus.SUCCEEDED
    res = {r["record_id"]: r for r in pq.read_table(out, ignore_prefixes=["_", "errors"]).to_pylist()}
    errs = {e["record_id"]: e for e in pq.read_table(out / "errors").to_pylist()}
    assert set(res) == {"plain", "words", "flat", "warm"}
    assert {k: e["error"] for k, e in errs.items()} == dict.fromkeys(["german", "packless", "hot", "listed"],
                                                                     "invalid_options")
    assert "cannot have: language 'de'" in errs["german"]["message"] and "English-only" in errs["german"]["message"]
    assert "options.pack" in errs["packless"]["message"] and "a record may set" in errs["packless"]["message"]
    assert "temperature" in errs["hot"]["message"] and "leave temperature out" in errs["hot"]["message"]
    assert "must be an object" in errs["listed"]["message"]
    ok = ("plain", "words", "flat", "warm")
    assert wer(SENTENCES[:4], [res[k]["text"] for k in ok]) <= 0.15, [res[k]["text"] for k in ok]
    assert all(s["words"] is None for s in res["plain"]["segments"])
    assert all(s["words"] for s in res["words"]["segments"])              # timestamps: word, this record only
    assert len(res["flat"]["segments"]) == 1                               # timestamps: none, one per window
    p = status(job_id)["progress"]
    assert p["audio_seconds_planned"] == p["audio_seconds_done"] > 0
    assert p["audio_seconds_planned"] == sum(int(np.ceil(r["duration_seconds"])) for r in res.values())
    assert p["audio_seconds_per_second"] > 0 and p["steps_planned"] is None


def test_a_running_shard_reports_the_audio_it_decoded(tiny_en: str) -> None:
    """The runtime counts the audio seconds of every batch of windows it decoded (packed or alone):
    a running attempt's heartbeats report them before its shard commits."""
    from batchinf.bundles import open_runtime
    from batchinf.tasks.transcribe import TranscribeOptions, transcribe_rows

    runtime = open_runtime(tiny_en)
    pcm = [resampled(wav_samples(synth(SENTENCES[k]))[0], 22050, 16000).astype("<i2") for k in range(3)]
    before = runtime.progress_done
    out = transcribe_rows(runtime, TranscribeOptions(), [x.tobytes() for x in pcm], [[(0, x.size)] for x in pcm],
                          ["a", "b", "c"], lambda: None, packable=[True, True, False])
    assert len(out.results) == 3
    assert runtime.progress_done - before == pytest.approx(sum(x.size for x in pcm) / 16000)


def test_plan_estimates_the_audio_hours_and_the_cost(tiny_en: str, tmp_path: Path) -> None:
    from batchinf.dryrun import plan_only, report

    inp = tmp_path / "in-plan"
    inp.mkdir()
    seconds = 0.0
    for k in range(3):
        wav = synth(SENTENCES[k], "en-us", 160)
        (inp / f"c{k}.wav").write_bytes(wav)
        samples, rate = wav_samples(wav)
        seconds += len(samples) / rate
    m = {"name": "plan-audio", "task": "transcribe", "bundle": "tiny-en@prod", "output": {"uri": str(tmp_path / "o")},
         "input": {"uri": str(inp) + "/", "format": "audio"}}
    job_id = plan_only(parse_manifest(m), Caller("default", operator=True))
    r = report(job_id, tokens_per_second=30.0, workers=2)
    assert r["records"] == 3 and r["audio_hours"] == pytest.approx(seconds / 3600, abs=3 / 3600)   # whole seconds
    assert r["estimate"]["worker_hours"] == pytest.approx(r["tokens"]["total"] / 30.0 / 3600)
    from click.testing import CliRunner

    from batchinf.cli import main

    (tmp_path / "job.json").write_text(json.dumps({**m, "name": "plan-audio-cli", "output": {"uri": str(tmp_path / "o2")}}))
    printed = CliRunner().invoke(main, ["plan", str(tmp_path / "job.json"), "--tokens-per-second", "30"])
    assert printed.exit_code == 0, printed.output
    assert "hours of audio" in printed.output and "at 30 audio-seconds/s" in printed.output
