"""Bundle import for speech models (task transcribe): a CTranslate2 Whisper directory
(model.bin, config.json, tokenizer.json, vocabulary.txt) becomes a pinned bundle. model.bin is
checked to be CTranslate2's format (not a pickle: no `.bin` enters a bundle) and stored as
model.ct2. bundle.json pins the feature extractor, the special tokens, the compute type per
device, the decoding defaults and a fixture: a short clip stored in the bundle
(fixtures/clip-0.wav, speech synthesised with espeak-ng when it is installed, else a
deterministic chirp) with the tokens the model gave it at import. Loading replays it: features
(planning) and tokens (workers) must come back as recorded, else the bundle is refused naming
the fixture and the difference."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import tempfile
import wave
from pathlib import Path
from typing import Any

import numpy as np

from batchinf.errors import BundleError
from batchinf.runtime.speech import need
from batchinf.runtime.speech.whisper import VOCABULARIES

FIXTURE_CLIP = "fixtures/clip-0.wav"
CONVERSION = "conversion.json"       # a converted bundle's record of its source
FIXTURE_TEXT = "Every file of the archive is transcribed by one pinned model."
DECODING_DEFAULTS = {"beam_size": 5, "best_of": 5, "max_length": 448, "temperatures": [0.0, 0.2, 0.4, 0.6, 0.8, 1.0],
                     "compression_ratio_threshold": 2.4, "logprob_threshold": -1.0, "no_speech_threshold": 0.6}
COMPUTE_TYPES = {"cpu": "int8", "cuda": "int8_float16"}


def ct2_spec(path: Path) -> str | None:
    """The model spec a CTranslate2 model.bin names in its header (e.g. WhisperSpec), else None."""
    from batchinf.runtime.speech.ct2_file import header

    try:
        with path.open("rb") as fh:
            version, spec, _, _ = header(fh)
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return spec if 1 <= version <= 16 and spec.isascii() and spec.isalnum() else None


def _whisper_config(config: dict[str, Any]) -> bool:
    return "suppress_ids" in config and "alignment_heads" in config


def is_ct2_whisper(config: dict[str, Any], src: Path) -> bool:
    return _whisper_config(config) and (src / "model.ct2").is_file()


def prepare_ct2_whisper(src: Path, tmp: Path) -> Path | None:
    """A CTranslate2 Whisper directory -> a bundle directory under `tmp` (model.bin -> model.ct2,
    plus the fixture clip); a transformers Whisper directory is converted to one first (with
    CTranslate2's converter; CONVERSION records what it was made from). None when `src` is
    neither."""
    try:
        config = json.loads((src / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and config.get("model_type") == "whisper" and not _whisper_config(config):
        return prepare_ct2_whisper(convert_transformers_whisper(src, tmp / "converted"), tmp)
    if not isinstance(config, dict) or not _whisper_config(config) or not (src / "model.bin").is_file():
        return None
    spec = ct2_spec(src / "model.bin")
    if spec != "WhisperSpec":
        raise BundleError(f"{src / 'model.bin'} is not a CTranslate2 Whisper model (its header names "
                          f"{spec or 'no CTranslate2 spec'}); convert the model with ct2-transformers-converter")
    vocab = next((v for v in VOCABULARIES if (src / v).is_file()), None)   # the converter writes vocabulary.json
    if vocab is None or not (src / "tokenizer.json").is_file():
        raise BundleError(f"{src}: a CTranslate2 Whisper directory needs tokenizer.json and vocabulary.txt")
    dst = tmp / "bundle"
    dst.mkdir(parents=True)
    shutil.copyfile(src / "model.bin", dst / "model.ct2")     # whisper.MODEL_FILE
    for name in ("config.json", "tokenizer.json", vocab, "preprocessor_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    if (src / CONVERSION).is_file():
        shutil.copyfile(src / CONVERSION, dst / CONVERSION)
    (dst / "fixtures").mkdir()
    write_wav(dst / FIXTURE_CLIP, fixture_samples(), 16000)
    return dst


def convert_transformers_whisper(src: Path, dst: Path) -> Path:
    """A transformers-format Whisper directory (safetensors weights, tokenizer.json) -> a
    CTranslate2 directory, weights kept in float16; CONVERSION pins the source files' digests."""
    from batchinf.digests import sha256_file
    from batchinf.runtime.bundle import bundle_files

    files = bundle_files(src)            # pickles refused, safetensors required
    if "tokenizer.json" not in files:
        raise BundleError(f"{src}: a transformers Whisper directory needs tokenizer.json")
    ctranslate2 = need("ctranslate2")
    copy = [f for f in ("tokenizer.json", "preprocessor_config.json") if f in files]
    try:
        ctranslate2.converters.TransformersConverter(str(src), copy_files=copy, load_as_float16=True).convert(
            str(dst), quantization="float16", force=True)
    except Exception as exc:  # noqa: BLE001 -- the converter's errors are many; the user needs the reason
        raise BundleError(f"{src}: CTranslate2's converter could not convert this Whisper model ({exc})") from None
    (dst / CONVERSION).write_text(json.dumps({
        "from": "transformers", "converter": f"ctranslate2 {ctranslate2.__version__} TransformersConverter",
        "quantization": "float16", "source_files": {f: sha256_file(src / f) for f in files}}, indent=1, sort_keys=True))
    return dst


def fixture_samples() -> np.ndarray:
    """The fixture clip, 16 kHz int16: FIXTURE_TEXT spoken by espeak-ng, else a chirp."""
    exe = shutil.which("espeak-ng")
    if exe is not None:
        from batchinf.runtime.speech.audio import decode_s16

        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "clip.wav"
            subprocess.run([exe, "-v", "en-us", "-s", "160", "-w", str(out), FIXTURE_TEXT], check=True,
                           capture_output=True, timeout=60)
            return decode_s16(out.read_bytes(), 16000, 60)[0]
    t = np.arange(4 * 16000) / 16000
    return (0.3 * np.sin(2 * np.pi * (200 + 150 * t) * t) * 32767).astype(np.int16)


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())


def build_speech_meta(src: Path, files: list[str], *, task: str, dtype: str) -> dict[str, Any]:
    import tokenizers

    from batchinf.digests import sha256_file
    from batchinf.runtime.bundle import BUNDLE_FORMAT
    from batchinf.runtime.speech.ct2_file import weights_dtype
    from batchinf.runtime.speech.runtime import SpeechRuntime
    from batchinf.runtime.speech.whisper import MODEL_FILE, special_tokens

    if FIXTURE_CLIP not in files:
        raise BundleError(f"{src}: {FIXTURE_CLIP} is missing; import the CTranslate2 directory itself")
    tok = tokenizers.Tokenizer.from_file(str(src / "tokenizer.json"))
    specials = special_tokens(tok)
    required = ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>", "<|startofprev|>")
    if any(n not in specials for n in required):
        raise BundleError(f"{src / 'tokenizer.json'} lacks Whisper's special tokens ({', '.join(required)})")
    config = json.loads((src / "config.json").read_text())
    languages = [tok.id_to_token(i).strip("<|>") for i in config.get("lang_ids") or []]
    pre = json.loads((src / "preprocessor_config.json").read_text()) if "preprocessor_config.json" in files else {}
    ctranslate2 = need("ctranslate2")
    meta: dict[str, Any] = {
        "format": BUNDLE_FORMAT, "task": task, "family": "whisper", "backend": "ctranslate2",
        "implementation": {"name": "ctranslate2", "version": ctranslate2.__version__},
        "precision": f"{COMPUTE_TYPES['cpu']} on CPU, {COMPUTE_TYPES['cuda']} on CUDA (CTranslate2)",
        "dtype": weights_dtype(src / MODEL_FILE), "max_length": 448, "compute_type": dict(COMPUTE_TYPES),
        "features": {"sample_rate": int(pre.get("sampling_rate", 16000)), "n_mels": int(pre.get("feature_size", 80)),
                     "hop": int(pre.get("hop_length", 160)), "n_fft": int(pre.get("n_fft", 400)),
                     "chunk_seconds": int(pre.get("chunk_length", 30))},
        "special_tokens": specials, "languages": languages, "decoding": dict(DECODING_DEFAULTS),
        "files": {f: sha256_file(src / f) for f in files},
    }
    if CONVERSION in files:
        meta["converted_from"] = json.loads((src / CONVERSION).read_text())
    runtime = SpeechRuntime(src, {**meta, "multilingual": False, "fixtures": []}, device="cpu")
    runtime.load_model(threads=1)
    meta["multilingual"] = bool(runtime.engine.model.is_multilingual)
    if runtime.engine.model.n_mels != meta["features"]["n_mels"]:
        raise BundleError(f"{src}: the model takes {runtime.engine.model.n_mels} mel bins, the feature extractor "
                          f"gives {meta['features']['n_mels']}; add the model's preprocessor_config.json")
    runtime.meta = {**meta, "fixtures": []}
    runtime.engine.multilingual = meta["multilingual"]
    feats = fixture_features(runtime)
    tokens = fixture_tokens(runtime, feats)
    meta["fixtures"] = [{"clip": FIXTURE_CLIP, "features_mean": round(float(feats.mean()), 6),
                         "features_std": round(float(feats.std()), 6), "tokens": tokens,
                         "text": runtime.engine.decode_text(tokens)}]
    return meta


def fixture_features(runtime: Any) -> np.ndarray:
    from batchinf.runtime.speech.audio import decode
    from batchinf.runtime.speech.features import batch_features

    samples, _ = decode((runtime.root / FIXTURE_CLIP).read_bytes(), runtime.spec.sample_rate, 60)
    return batch_features([samples], runtime.spec)


def fixture_tokens(runtime: Any, feats: np.ndarray) -> list[int]:
    from batchinf.runtime.speech.whisper import Decoding

    results, _ = runtime.engine.generate(feats, Decoding(language="en" if runtime.meta["multilingual"] else None,
                                                         temperatures=(0.0,)))
    return [int(t) for t in results[0].tokens]


def verify_speech_inputs(runtime: Any) -> None:
    """The fixture clip must give the features recorded at import (decoder or numpy drift), and
    the tokenizer must decode its tokens to the recorded text."""
    for i, fx in enumerate(runtime.meta["fixtures"]):
        feats = fixture_features(runtime)
        got = (round(float(feats.mean()), 6), round(float(feats.std()), 6))
        if abs(got[0] - fx["features_mean"]) > 1e-4 or abs(got[1] - fx["features_std"]) > 1e-4:
            raise BundleError(f"feature drift in bundle {runtime.root}: fixture clip {i} ({fx['clip']}) gives log-mel "
                              f"mean/std {got}, import recorded {(fx['features_mean'], fx['features_std'])} (PyAV/FFmpeg "
                              "or numpy changed?); pin the versions the bundle was imported with, or re-import it")
        text = runtime.tokenizer.decode([t for t in fx["tokens"] if t < runtime.meta["special_tokens"]["<|endoftext|>"]])
        if text != fx["text"]:
            raise BundleError(f"tokenizer drift in {runtime.root / 'tokenizer.json'}: fixture {i} decodes to "
                              f"{text!r}, import recorded {fx['text']!r}; re-import the bundle")


def verify_speech_tokens(runtime: Any) -> None:
    """Each fixture clip must give the tokens recorded at import (on CPU exactly; on CUDA, whose
    compute type differs, the same text)."""
    for i, fx in enumerate(runtime.meta["fixtures"]):
        got = fixture_tokens(runtime, fixture_features(runtime))
        cuda = runtime.device.startswith("cuda")
        same = _words(runtime.engine.decode_text(got)) == _words(fx["text"]) if cuda else got == fx["tokens"]
        if not same:
            first = next((j for j, (a, b) in enumerate(zip(got, fx["tokens"])) if a != b), min(len(got), len(fx["tokens"])))
            raise BundleError(f"model fixture {i} of bundle {runtime.root} ({fx['clip']}) no longer gives its recorded "
                              f"tokens (first difference at position {first}: got {runtime.engine.decode_text(got)!r}, "
                              f"recorded {fx['text']!r}): weights or CTranslate2 changed; restore the bundle or re-import it")


def _words(text: str) -> list[str]:
    return "".join(ch.lower() if ch.isalnum() or ch.isspace() else " " for ch in text).split()
