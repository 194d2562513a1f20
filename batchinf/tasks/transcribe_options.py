"""Task transcribe's options: the job's (`TranscribeOptions`), what a bundle cannot honour
(`option_problem`), the options a JSONL / Parquet record sets for itself (`record_options`,
staged with its row, `options_of` at run time), and the decoding they resolve to with the
bundle's defaults (`decoding_for`)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import numpy as np
from pydantic import Field

from batchinf.manifest_rules import BOOLEAN, STRING, Rule, Section, choice, nullable, number, positive
from batchinf.tasks.embed import DEVICES

TIMESTAMPS = ("segment", "word", "none")
SPEECH_TASKS = ("transcribe", "translate")


def _language_problem(v: Any, where: str) -> str | None:
    if isinstance(v, str) and 2 <= len(v) <= 8 and v.isascii() and v.isalpha() and v.islower():
        return None
    return f"{where} {v!r:.40} is not a language code (en, de, haw, ...)"


SUBTITLES = ("srt", "vtt")
FORMATS = Rule(lambda v, w: None if isinstance(v, (list, tuple)) and all(x in SUBTITLES for x in v) and
               len(set(v)) == len(v) else f"{w} must be a list of subtitle formats ({', '.join(SUBTITLES)}), got {v!r:.60}",
               {"type": "array", "items": {"enum": list(SUBTITLES)}, "uniqueItems": True}, tuple)
LANGUAGE = Rule(_language_problem, {"type": "string", "pattern": "^[a-z]{2,8}$"})


class TranscribeOptions(Section):
    """Options of task transcribe."""
    language: Annotated[str | None, nullable(LANGUAGE)] = Field(
        None, description="the spoken language's code (en, de, ...); null: detected per window on a multilingual "
                          "model (English-only models transcribe English)")
    task: Annotated[str, choice(SPEECH_TASKS)] = Field(
        "transcribe", description="translate: English text from speech in another language (multilingual models)")
    timestamps: Annotated[str, choice(TIMESTAMPS)] = Field(
        "segment", description="segment: segments with start and end times; word: also each segment's words "
                               "with theirs (cross-attention alignment); none: one segment per window")
    initial_prompt: Annotated[str | None, nullable(STRING)] = Field(
        None, description="text that conditions every window (spellings, names, style)")
    temperature: Annotated[float, number(0, 1)] = Field(0.0, description="0: greedy (or beam search)")
    temperature_fallback: Annotated[bool, BOOLEAN] = Field(
        True, description="decode a window again at a higher temperature (+0.2 up to 1.0) when its text repeats "
                          "itself (compression ratio > 2.4) or is improbable (average log-probability < -1)")
    beam_size: Annotated[int, positive(16)] = Field(5, description="beams at temperature 0 (1: greedy)")
    vad: Annotated[bool, BOOLEAN] = Field(
        True, description="cut long files into windows at silence; false: at every 30 s whatever is said")
    max_batch_windows: Annotated[int, positive(256)] = Field(16, description="30-second windows per model batch")
    pack: Annotated[bool, BOOLEAN] = Field(
        True, description="lay short files end to end, 1 s of silence apart, in shared 30-second windows (one "
                          "encoder pass for several clips; each segment goes back to its file, and a file the "
                          "split is unsure of is decoded alone); false: every file in windows of its own")
    seed: Annotated[int, positive(1 << 62)] = Field(1, description="seed of the fallback's sampling")
    formats: Annotated[tuple[str, ...], FORMATS] = Field(
        (), description="subtitle files besides the Parquet rows: srt and/or vtt, one per input file under "
                        "srt/ and vtt/, listed in _MANIFEST.json")
    device: Annotated[str, choice(DEVICES)] = "auto"


def option_problem(meta: dict[str, Any], options: Any, where: str = "options.") -> str | None:
    """What the options ask that the bundle cannot do, or None; `where` prefixes their names."""
    if meta["multilingual"]:
        if options.language is not None and options.language not in meta["languages"]:
            return (f"{where}language {options.language!r} is not one of the bundle's languages "
                    f"({', '.join(meta['languages'][:20])}, ...)")
        return None
    if options.task == "translate":
        return (f"{where}task translate needs a multilingual Whisper model; this bundle is English-only (.en): "
                "it transcribes English, use task: transcribe or a multilingual bundle")
    if options.language not in (None, "en"):
        return (f"{where}language {options.language!r}: this bundle is an English-only (.en) model; "
                "use a multilingual bundle for other languages")
    return None


# what a JSONL / Parquet record may set for itself, as a field of its own or in an object `options`
# (`prompt`, OpenAI's name, stands for initial_prompt); the rest is the job's
RECORD_OPTIONS = ("language", "task", "timestamps", "initial_prompt", "temperature", "beam_size")
MAX_RECORD_PROMPT_CHARS = 4096      # far above the 223 tokens Whisper keeps of a prompt
OWN = "sets an option it cannot have: "


def record_options(fields: dict[str, Any], job: TranscribeOptions, meta: dict[str, Any]
                   ) -> tuple[dict[str, Any] | None, str | None]:
    """A record's own options -> (those it sets, checked and converted, or None when it sets none;
    None), or (None, what is wrong with them and how to fix it)."""
    given = {k: fields[k] for k in ("prompt", *RECORD_OPTIONS) if fields.get(k) is not None}
    nested = fields.get("options")
    if nested is not None:
        if not isinstance(nested, dict):
            return None, (f"has options {nested!r:.60}, which must be an object of transcribe options "
                          f"({', '.join(RECORD_OPTIONS)})")
        if unknown := sorted(set(nested) - {"prompt", *RECORD_OPTIONS}):
            return None, (f"has options.{unknown[0]:.40}, which a record cannot set; a record may set "
                          f"{', '.join(RECORD_OPTIONS)} (the rest is the job's options)")
        given.update({k: v for k, v in nested.items() if v is not None})
    if "prompt" in given:
        given.setdefault("initial_prompt", given["prompt"])
        del given["prompt"]
    if not given:
        return None, None
    own = {}
    for name, value in given.items():
        rule = next(m for m in TranscribeOptions.model_fields[name].metadata if isinstance(m, Rule))
        if problem := rule.problem(value, name):
            return None, f"{OWN}{problem}; fix the record, or leave {name} out to use the job's"
        own[name] = rule.convert(value)
    if len(own.get("initial_prompt") or "") > MAX_RECORD_PROMPT_CHARS:
        return None, (f"{OWN}initial_prompt of {len(own['initial_prompt'])} characters is over "
                      f"{MAX_RECORD_PROMPT_CHARS}; Whisper reads only a prompt's last 223 tokens: shorten it")
    if problem := option_problem(meta, job.model_copy(update=own), where=""):
        return None, OWN + problem
    return own, None


def options_of(job: TranscribeOptions, staged: list[str | None]) -> list[TranscribeOptions]:
    """Each staged row's options: the job's, with what its record sets (`record_options` column);
    rows that set the same share one object."""
    resolved: dict[str | None, TranscribeOptions] = {None: job}
    for s in staged:
        if s not in resolved:
            resolved[s] = job.model_copy(update=json.loads(s))
    return [resolved[s] for s in staged]


def decoding_for(runtime: Any, options: Any) -> Any:
    """Options (the job's, or a record's: `options_of`) resolved with the bundle's decoding defaults
    (runtime/speech/whisper.Decoding)."""
    from batchinf.runtime.speech.whisper import Decoding

    d = runtime.meta["decoding"]
    temps = (options.temperature,)
    if options.temperature_fallback:
        temps += tuple(round(t, 2) for t in np.arange(options.temperature + 0.2, 1.0001, 0.2))
    prompt = runtime.engine.encode_text(" " + options.initial_prompt.strip()) if options.initial_prompt else []
    return Decoding(language=options.language, task=options.task, timestamps=options.timestamps != "none",
                    initial_prompt=prompt, temperatures=temps, beam_size=options.beam_size,
                    best_of=d["best_of"], max_length=d["max_length"],
                    compression_ratio_threshold=d["compression_ratio_threshold"],
                    logprob_threshold=d["logprob_threshold"], no_speech_threshold=d["no_speech_threshold"],
                    seed=options.seed)
