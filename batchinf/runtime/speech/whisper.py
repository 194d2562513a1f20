"""The CTranslate2 Whisper engine: batches of log-mel windows ([B, n_mels, frames]) -> tokens,
average log-probability, no-speech probability and the temperature used, with the usual
fallback (a window whose output repeats itself or is improbable is decoded again, sampled at the
next temperature). The pinned bundle files are the ones loaded: model.ct2 (CTranslate2's
model.bin, renamed so no `.bin` sits in a bundle), config.json and vocabulary.txt, passed to
CTranslate2 from memory."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from batchinf.runtime.speech import need

MODEL_FILE = "model.ct2"
CT2_FILES = {"model.bin": MODEL_FILE, "config.json": "config.json"}
VOCABULARIES = ("vocabulary.txt", "vocabulary.json")      # the one the bundle has
SPECIAL_NAMES = ("<|endoftext|>", "<|startoftranscript|>", "<|startofprev|>", "<|notimestamps|>",
                 "<|transcribe|>", "<|translate|>", "<|startoflm|>", "<|nocaptions|>")
MAX_PROMPT = 223          # tokens of initial_prompt kept (max_length // 2 - 1)
MIN_UNSAID_SECONDS = 0.3  # a window that stops closer than this to its sound's end is taken as it is


@dataclass(frozen=True)
class Decoding:
    """How windows are decoded (the job's options resolved with the bundle's defaults)."""
    language: str | None = None
    task: str = "transcribe"
    timestamps: bool = True
    initial_prompt: list[int] = field(default_factory=list)
    temperatures: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    beam_size: int = 1
    best_of: int = 5
    max_length: int = 448
    compression_ratio_threshold: float = 2.4
    logprob_threshold: float = -1.0
    no_speech_threshold: float = 0.6
    seed: int = 0


@dataclass
class WindowResult:
    tokens: list[int]
    avg_logprob: float
    no_speech_prob: float
    temperature: float
    compression_ratio: float


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """The special tokens' ids (bundle.json pins them), language tokens aside."""
    out = {}
    for name in SPECIAL_NAMES:
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            out[name] = int(tid)
    return out


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


class WhisperEngine:
    """One loaded model (per worker process)."""

    def __init__(self, root: Path, meta: dict[str, Any], tokenizer: Any, device: str = "cpu",
                 threads: int = 1) -> None:
        ctranslate2 = need("ctranslate2")
        self.meta = meta
        self.specials = meta["special_tokens"]
        self.multilingual = bool(meta["multilingual"])
        self.tokenizer = tokenizer      # the bundle's tokenizer.json, loaded by its SpeechRuntime
        kind = self.device = "cuda" if device.startswith("cuda") else "cpu"
        files = {name: (root / stored).read_bytes() for name, stored in CT2_FILES.items()}
        files.update({v: (root / v).read_bytes() for v in VOCABULARIES if v in meta["files"]})
        self.model = ctranslate2.models.Whisper(f"batchinf-bundle:{root.name}", device=kind,
                                                compute_type=meta["compute_type"][kind], intra_threads=threads,
                                                inter_threads=1, files=files)
        self.timestamp_begin = self.specials["<|notimestamps|>"] + 1
        self.eot = self.specials["<|endoftext|>"]

    # --- prompts ---------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt(self, d: Decoding, language: str | None) -> list[int]:
        s = self.specials
        out = []
        if d.initial_prompt:
            out += [s["<|startofprev|>"], *d.initial_prompt[-MAX_PROMPT:]]
        out.append(s["<|startoftranscript|>"])
        if self.multilingual:
            lang = self.tokenizer.token_to_id(f"<|{language or 'en'}|>")
            out += [lang, s["<|translate|>" if d.task == "translate" else "<|transcribe|>"]]
        if not d.timestamps:
            out.append(s["<|notimestamps|>"])
        return out

    def sot_sequence(self, language: str | None, task: str = "transcribe") -> list[int]:
        s = self.specials
        if not self.multilingual:
            return [s["<|startoftranscript|>"]]
        return [s["<|startoftranscript|>"], self.tokenizer.token_to_id(f"<|{language or 'en'}|>"),
                s["<|translate|>" if task == "translate" else "<|transcribe|>"]]

    def words(self, features: np.ndarray, results: list[WindowResult], frames: list[int],
              langs: list[str | None], task: str) -> list[list[dict[str, Any]]]:
        """Each window's words with times relative to its start (runtime/speech/words.py)."""

        from batchinf.runtime.speech.words import align_words

        encoded = self.encode(features)
        texts = [[t for t in r.tokens if t < self.eot] for r in results]
        return align_words(self.model, encoded, self.sot_sequence(langs[0], task), texts, frames, self.decode_text)

    def detect_languages(self, features: Any) -> list[str]:
        """Each window's most probable language code (multilingual models)."""
        return [r[0][0].strip("<|>") for r in self.model.detect_language(features)]

    # --- decoding ----------------------------------------------------------------------------
    def decode_text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([t for t in tokens if t < self.eot])

    def generate(self, features: np.ndarray, d: Decoding,
                 sound_ends: list[float] | None = None) -> tuple[list[WindowResult], list[str | None]]:
        """Windows' features [B, n_mels, frames] (each one's sound ending `sound_ends` seconds
        into it: windows.sound_end) -> a result per window, and each window's language (detected
        on a multilingual model unless the options name one). A window whose decoding opened a
        segment and stopped, seconds before its sound ends, is continued (`_continue`)."""
        encoded = self.encode(features)
        whole = encoded
        langs: list[str | None] = [d.language] * len(features)
        if self.multilingual and d.language is None:
            langs = self.detect_languages(encoded)
        else:
            langs = [d.language or "en"] * len(features)
        results: list[WindowResult | None] = [None] * len(features)
        todo = list(range(len(features)))
        for k, temperature in enumerate(d.temperatures):
            if not todo:
                break
            if len(todo) < len(features):      # the windows left
                encoded = self._rows(whole, features, todo)
            got = self._run(encoded, [self.prompt(d, langs[i]) for i in todo], d, temperature, k)
            again = []
            for i, r in zip(todo, got):
                results[i] = r
                silent = r.no_speech_prob > d.no_speech_threshold and r.avg_logprob < d.logprob_threshold
                if not silent and (r.compression_ratio > d.compression_ratio_threshold
                                   or r.avg_logprob < d.logprob_threshold):
                    again.append(i)
            todo = again
        done = [r for r in results if r is not None]
        if d.timestamps and sound_ends is not None:
            self._continue(whole, features, done, langs, d, sound_ends)
        return done, langs

    def encode(self, features: np.ndarray) -> Any:
        """The encoder's output for windows' features [B, n_mels, frames]. On CPU each window is
        encoded alone and the outputs joined: the same numbers, in 0.65-0.7 of the time of one
        batched call (its attention scores, 54 MB a window, outgrow the caches)."""
        import ctranslate2

        def run(x: np.ndarray) -> Any:
            return self.model.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(x, dtype=np.float32)),
                                     to_cpu=False)

        if self.device != "cpu" or len(features) == 1:
            return run(features)
        return ctranslate2.StorageView.from_array(np.concatenate([np.asarray(run(features[i:i + 1]))
                                                                  for i in range(len(features))]))

    def _rows(self, encoded: Any, features: np.ndarray, rows: list[int]) -> Any:
        """The encoder's output for some of a batch's windows: sliced on CPU, encoded again on CUDA."""
        import ctranslate2

        if self.device == "cpu":
            return ctranslate2.StorageView.from_array(np.ascontiguousarray(np.asarray(encoded)[rows]))
        return self.encode(features[rows])

    def _continue(self, encoded: Any, features: np.ndarray, results: list[WindowResult],
                  langs: list[str | None], d: Decoding, sound_ends: list[float]) -> None:
        """Whisper sometimes closes a segment, opens the next and stops, seconds before its window's
        sound ends, the last words unsaid (its own loop seeks there and decodes the rest in the
        next window). Such a window is decoded on from where it stopped, once: its tokens so far
        become the previous-text context (`<|startofprev|>`, as an initial prompt is), and the
        timestamp that opened the last segment is the one forced token after the start sequence, so
        the decoder goes on from that time with everything said before in view. CTranslate2 reads a
        context in one pass but feeds forced tokens one decoding step each: the window's whole
        first pass as forced tokens (about 100) cost 4-5 times this. At temperature 0 the
        continuation is greedy: beams cost as much as the window's first pass, for the few words
        left. Nothing but the window itself decides it: windows are continued together only where
        their contexts are as long (CTranslate2 wants the start sequence at one place in a batch).
        A window that stopped where only quiet is left (a cut at a pause leaves some) is taken as
        it is: its continuation would cost a decoding and say nothing."""
        from batchinf.runtime.speech.segments import stopped_short

        todo = [i for i, r in enumerate(results)
                if stopped_short(r.tokens, self.eot, self.timestamp_begin, sound_ends[i] - MIN_UNSAID_SECONDS)]
        if not todo:
            return
        prompts = {i: self.continuation_prompt(d, langs[i], results[i].tokens) for i in todo}
        groups: dict[tuple[float, int], list[int]] = {}
        for i in todo:
            groups.setdefault((results[i].temperature, len(prompts[i])), []).append(i)
        for (temperature, _), rows in groups.items():
            step = d.temperatures.index(temperature) if temperature in d.temperatures else 0
            got = self._run(self._rows(encoded, features, rows), [prompts[i] for i in rows],
                            replace(d, beam_size=1), temperature, step, scores=False)
            for i, tokens in zip(rows, got):
                r = results[i]
                if len(tokens) > 1 and tokens[0] == r.tokens[-1]:     # from the forced timestamp on
                    r.tokens = r.tokens + tokens[1:]

    def continuation_prompt(self, d: Decoding, language: str | None, tokens: list[int]) -> list[int]:
        """The prompt that decodes a window on from its last token, a timestamp that opened a
        segment: the initial prompt and the tokens before it as context, the start sequence, then
        that timestamp."""
        s = self.specials
        context = [*d.initial_prompt, *tokens[:-1]][-MAX_PROMPT:]
        return [s["<|startofprev|>"], *context, *self.sot_sequence(language, d.task), tokens[-1]]

    def _run(self, encoded: Any, prompts: list[list[int]], d: Decoding, temperature: float,
             step: int, scores: bool = True) -> Any:
        import ctranslate2

        if temperature > 0:
            ctranslate2.set_random_seed(d.seed + step)      # byte-identical retries
            kw = dict(beam_size=1, num_hypotheses=d.best_of, sampling_topk=0, sampling_temperature=temperature)
        else:
            kw = dict(beam_size=d.beam_size)
        out = self.model.generate(encoded, prompts, max_length=d.max_length, return_scores=True,
                                  return_no_speech_prob=True, suppress_blank=True, suppress_tokens=[-1], **kw)
        if not scores:      # each window's best tokens (a continuation's: from its forced timestamp on)
            return [list(r.sequences_ids[max(range(len(r.sequences_ids)), key=lambda h: r.scores[h])]) for r in out]
        results = []
        for r in out:
            best = max(range(len(r.sequences_ids)), key=lambda h: r.scores[h])
            tokens = list(r.sequences_ids[best])
            n = len(tokens)
            results.append(WindowResult(tokens, float(r.scores[best]) * n / (n + 1), float(r.no_speech_prob),
                                        temperature, compression_ratio(self.decode_text(tokens))))
        return results
