"""Task transcribe: speech -> timestamped text with a Whisper bundle run by CTranslate2.

Input: a prefix of audio objects (`input.format: audio`: wav, flac, mp3, ogg/opus, m4a; each
object is a record, its key under the prefix its id), or JSONL / Parquet records whose
`input.audio_field` holds the audio's bytes or an object URI (pinned, and within the grants of a
confined job, like an image URI: tasks/objects.py), and may set some options for themselves
(tasks/transcribe_options.py; wrong ones are an invalid_options error row). At plan time each
file's header is checked against BATCHINF_MAX_AUDIO_SECONDS before it is decoded (bounded in
samples and time), downmixed to mono, resampled to the bundle's rate, and cut into windows of at
most 30 s at silence (runtime/speech/windows.py); the staged row holds the 16-bit samples, the
windows and the record's own options.
A file whose windows span more than a piece (`piece_seconds`: the manifest's `shards.max_tokens`
up to a model batch of windows, else 2 minutes) is staged as several rows, its pieces:
consecutive runs of the one window plan, each with its own samples and its windows' places in
the file, bucketed and sharded like any row, so a long file runs on many shards and workers at
once. Length measure: the row's duration in seconds. At execute, short files share 30-second
windows (`options.pack`, runtime/speech/packing.py), the windows of every row of the shard run
in batches of `max_batch_windows`, and each file's transcript is stitched from its windows
(segments in order, absolute times); a piece's transcript is a row of PIECE_SCHEMA, and its
file's one row (or error row) is stitched from all its pieces at publish (`assemble`,
runtime/speech/pieces.py).

Bad audio is an error row naming the file: empty_audio, not_audio, bad_audio, truncated_audio,
audio_too_long, audio_too_large, audio_decode_timeout, and no_speech_found (a file that is not
silent yet gives no text: noise, or a damaged file that decodes as noise)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchinf import failpoints
from batchinf.errors import InputError, JobStopped, ManifestError
from batchinf.runtime.speech.features import FeatureSpec
from batchinf.runtime.speech.packing import GAP_SECONDS
from batchinf.tasks.base import (FIELD_TASKS, INPUT_DEFAULTS, INPUT_FIELDS, PIECE, RECORD_FIELDS, STAGE_FIELDS,
                                 Assembled, RunOutput, StagedRows, Task, ok_rows, record_columns, usable_records)
from batchinf.tasks.batching import hit_record_failpoints, isolate
from batchinf.tasks.transcribe_options import (TranscribeOptions, decoding_for, option_problem, options_of,
                                              record_options)

SPEECH_STAGE_SCHEMA = pa.schema(STAGE_FIELDS + [
    ("samples", pa.large_binary()),                 # int16 little-endian, mono, at the bundle's rate
    ("window_starts", pa.list_(pa.int64())), ("window_ends", pa.list_(pa.int64())),   # in samples
    ("duration_seconds", pa.float64()), ("audio_sha256", pa.string()),      # the whole file's
    # a file staged in pieces: this row's number (PIECE) and their count (1: the file is one row),
    # its first window's number in the file; and (pieces only) whether the whole file is silent
    (PIECE, pa.int32()), ("pieces", pa.int32()), ("first_window", pa.int32()), ("silent", pa.bool_()),
    # the options a JSONL / Parquet record sets for itself (`record_options`), as JSON; null: the job's
    ("record_options", pa.string()),
])
WORD = pa.struct([("word", pa.string()), ("start", pa.float64()), ("end", pa.float64()), ("probability", pa.float64())])
SEGMENT = pa.struct([
    ("id", pa.int32()), ("seek", pa.int32()), ("start", pa.float64()), ("end", pa.float64()),
    ("text", pa.string()), ("tokens", pa.list_(pa.int32())), ("temperature", pa.float64()),
    ("avg_logprob", pa.float64()), ("compression_ratio", pa.float64()), ("no_speech_prob", pa.float64()),
    ("words", pa.list_(WORD)),        # timestamps: word only (else null)
])
TRANSCRIPT_SCHEMA = pa.schema(RECORD_FIELDS + [
    ("text", pa.string()), ("language", pa.string()), ("duration_seconds", pa.float64()),
    ("segments", pa.list_(SEGMENT)), ("output_tokens", pa.int32()), ("audio_sha256", pa.string()),
])
# A piece's transcript (`RunOutput.pieces`), stitched with its file's other pieces at publish:
# segments with times in the file, each window's language, or the piece's error (code, message
# naming the record, the file and the window's times; `attempts` set by execute)
PIECE_SCHEMA = pa.schema(RECORD_FIELDS + [
    (PIECE, pa.int32()), ("pieces", pa.int32()), ("segments", pa.list_(SEGMENT)), ("languages", pa.list_(pa.string())),
    ("output_tokens", pa.int32()), ("duration_seconds", pa.float64()), ("audio_sha256", pa.string()),
    ("silent", pa.bool_()), ("error", pa.string()), ("message", pa.string()), ("attempts", pa.int32()),
])
MAX_STAGED_BYTES = 2 << 30      # an object's staged samples (32 KB per second of audio) at most
def record_id_of(uri: str, input_uri: str | None) -> str:
    """An audio object's record id: its key under the input prefix (the whole key otherwise)."""
    if input_uri and input_uri.endswith("/") and uri.startswith(input_uri):
        return uri[len(input_uri):]
    _, _, rest = uri.partition("://")
    return rest.split("/", 1)[1] if "/" in rest else rest


def _input_prefix(obj: Any) -> str | None:
    from batchinf.store import normalize_uri

    uri = getattr(obj.input, "uri", None)
    return normalize_uri(uri) if uri else None


PIECE_WINDOWS = 4      # a piece by default: 2 minutes of 30-second windows, so a few long files spread over every worker


def piece_seconds(options: Any, chunk_seconds: float, shard_work: int = 0) -> float:
    """The most audio one staged row holds (a longer file is staged in pieces): what a shard holds
    when the manifest says (`shards.max_tokens`, in seconds for this task) up to a model batch of
    windows, else PIECE_WINDOWS windows (a shard's batches fill with the windows of its several
    pieces); a piece holds one window at least."""
    if shard_work:
        return float(min(shard_work, options.max_batch_windows * chunk_seconds))
    return float(PIECE_WINDOWS * chunk_seconds)


class Transcribe(Task):
    name = "transcribe"
    options = TranscribeOptions
    fields = ("audio_field",)
    stage_schema = SPEECH_STAGE_SCHEMA
    summary_columns = ("duration_seconds",)
    needs = ("config.json", "tokenizer.json")
    weights = ".ct2"
    uses_torch = False          # CTranslate2
    # work is audio seconds: a shard of a minute computes for seconds on one core (tiny.en int8
    # decodes 15-50 audio-seconds per CPU-second), over 10 times its fixed cost; a long file spreads
    min_shard_work = 60
    piece_schema = PIECE_SCHEMA
    progress_unit = "audio_seconds"

    def shard_floor(self, options: Any, records: int, work: int, workers: int | None) -> int | None:
        """A shard's windows run in batches of up to `max_batch_windows`, and a small batch decodes
        each window slower (beam 5, tiny.en int8, one thread: 0.49 s a window in batches of 3, 0.40
        in batches of 9), so the floor is one full batch of windows, or an equal share of the
        workers for a smaller job, and never under the task's minute: three long files on two
        workers are two shards of nine windows, not six of three."""
        full = (options or TranscribeOptions()).max_batch_windows * FeatureSpec.chunk_seconds
        return max(self.min_shard_work, min(full, work // max(1, workers or 1)))

    def input_problem(self, inp: Any) -> str | None:
        if inp.format not in ("audio", "jsonl", "parquet"):
            return ("task transcribe reads audio objects (input.format: audio) or records naming them "
                    "(jsonl / parquet with input.audio_field)")
        if inp.format == "audio" and inp.audio_field is not None:
            return "input.audio_field is for jsonl / parquet records; with input.format audio each object is the audio"
        for name in (n for n in INPUT_FIELDS if n != "audio_field"):
            if getattr(inp, name, None) not in (None, INPUT_DEFAULTS.get(name)):
                return f"input.{name} is for task: {FIELD_TASKS[name]}; a job of task transcribe reads audio files"
        return None

    def limits(self, runtime: Any, options: Any) -> tuple[int, bool]:
        """No token limits; the options are checked against the bundle here, once per planning."""
        problem = option_problem(runtime.meta, options)
        if problem:
            raise ManifestError(problem)
        return 0, False

    def stage(self, obj: Any, runtime: Any, records: Iterator[Any]) -> pa.Table:
        from batchinf.config import settings
        from batchinf.formats.audio import MAX_AUDIO_BYTES
        from batchinf.runtime.speech.audio import AudioProblem, decode_s16
        from batchinf.runtime.speech.pieces import piece_runs
        from batchinf.runtime.speech.windows import is_silent, plan_windows
        from batchinf.tasks.objects import RecordObjectProblem, record_object

        spec, max_seconds = runtime.spec, settings().max_audio_seconds
        piece = piece_seconds(obj.options, spec.chunk_seconds, obj.shard_work)
        window = spec.chunk_seconds if obj.options.vad else None
        prefix = _input_prefix(obj)
        rows = StagedRows(SPEECH_STAGE_SCHEMA)
        staged = 0
        if obj.fmt == "audio":         # the object is the audio; its key the id
            rid = record_id_of(obj.pin.uri, prefix)
            records = (replace(r, record_id=rid) for r in records)
        field = obj.input.audio_field or "audio"
        for row, rec, where in usable_records(obj, records, rows):
            value = (rec.fields or {}).get(field)
            if obj.fmt != "audio":
                own, problem = record_options(rec.fields or {}, obj.options, runtime.meta)
                if problem:
                    row.update(error="invalid_options", message=f"{where} {problem}")
                    continue
                row["record_options"] = json.dumps(own, sort_keys=True) if own else None
            try:
                if obj.fmt == "audio":
                    where, data = f"audio file {obj.pin.uri}", value or b""
                elif value is None:
                    raise AudioProblem("missing_audio", f"has no audio field {field!r} (set input.audio_field if "
                                                        "it has another name)")
                else:
                    data = record_object(value, obj, "audio", MAX_AUDIO_BYTES)
                pcm = decode_s16(data, spec.sample_rate, max_seconds)[0].astype("<i2", copy=False)
            except (AudioProblem, RecordObjectProblem) as exc:
                row.update(error=exc.code, message=f"{where} {exc}")
                continue
            staged += pcm.nbytes
            if staged > MAX_STAGED_BYTES:
                raise InputError(f"{where} decodes to more than {MAX_STAGED_BYTES >> 20} MiB of samples; "
                                 "cut it into shorter files")
            audio = pcm.astype(np.float32) / 32768.0
            if window is None:
                step = spec.chunk_samples
                wins = [(a, min(a + step, pcm.size)) for a in range(0, pcm.size, step)]
            else:
                wins = plan_windows(audio, spec.sample_rate, window)
            runs = piece_runs(wins, int(piece * spec.sample_rate))
            whole = {"duration_seconds": pcm.size / spec.sample_rate, "audio_sha256": hashlib.sha256(data).hexdigest(),
                     "pieces": len(runs), "silent": None if len(runs) == 1 else is_silent(audio, spec.sample_rate)}
            for k, (i, j) in enumerate(runs):    # one row, or a row per piece: its samples, its windows' places
                a, b = wins[i][0], wins[j - 1][1]
                mine = row if k == 0 else dict(row)
                mine.update(samples=pcm[a:b].tobytes(), window_starts=[x for x, _ in wins[i:j]],
                            window_ends=[y for _, y in wins[i:j]], n_tokens=max(1, int(np.ceil((b - a) / spec.sample_rate))),
                            first_window=i, **{PIECE: k}, **whole)
                if k:
                    rows.append(mine)
        return rows.table()

    def result_schema(self, meta: dict[str, Any], options: Any = None) -> pa.Schema:
        return TRANSCRIPT_SCHEMA

    def planned_progress(self, staged: pa.Table | pa.RecordBatch) -> int | None:
        """The staged rows' audio seconds (each row's whole seconds, `n_tokens`)."""
        return int(pc.sum(pc.filter(staged.column("n_tokens"), pc.is_null(staged.column("error")))).as_py() or 0)

    def run(self, c: dict[str, list[Any]], runtime: Any, options: Any, check: Callable[[], None],
            split: Callable[[], bool] | None = None, files: Any = None) -> RunOutput:
        valid = ok_rows(c)
        counts = c.get("pieces") or [1] * len(c["error"])      # staged before pieces existed: every file whole
        rate = runtime.spec.sample_rate
        windows = [list(zip(c["window_starts"][i], c["window_ends"][i])) for i in valid]
        # a piece's samples start at its first window: its windows are run relative to them, and
        # its segments timed (and windows numbered) in its file
        places = {u: (c["first_window"][i], windows[u][0][0]) for u, i in enumerate(valid) if (counts[i] or 1) > 1}
        for u, (_, at) in places.items():
            windows[u] = [(a - at, b - at) for a, b in windows[u]]
        stopped = {u: msg for u, (first, at) in places.items()
                   if (msg := _piece_failpoint(c["record_id"][valid[u]], c[PIECE][valid[u]], first, at, windows[u], rate))}
        todo = [u for u in range(len(valid)) if u not in stopped]
        own = c.get("record_options") or [None] * len(c["error"])     # staged before records set options: none
        out = transcribe_rows(runtime, options, [c["samples"][valid[u]] for u in todo], [windows[u] for u in todo],
                              [c["record_id"][valid[u]] for u in todo], _checking_stop(check, split),
                              packable=[u not in places for u in todo],
                              pieces={n: places[u] for n, u in enumerate(todo) if u in places},
                              file_options=options_of(options, [own[valid[u]] for u in todo]))
        results = {todo[n]: r for n, r in out.results.items()}
        failed = {**{todo[n]: msg for n, msg in out.failures.items()}, **stopped}
        codes = {todo[n]: code for n, code in out.codes.items()}
        failures = {valid[u]: f"audio file {c['source'][valid[u]]} {msg}" for u, msg in failed.items() if u not in places}
        done = [u for u in range(len(valid)) if u in results and u not in places]
        ok = [valid[u] for u in done]
        res = [results[u] for u in done]
        table = pa.table({
            **record_columns(c, ok), "text": [r["text"] for r in res], "language": [r["language"] for r in res],
            "duration_seconds": [c["duration_seconds"][i] for i in ok], "segments": [r["segments"] for r in res],
            "output_tokens": [r["output_tokens"] for r in res], "audio_sha256": [c["audio_sha256"][i] for i in ok],
        }, schema=TRANSCRIPT_SCHEMA)
        computed = ok + [valid[u] for u in places if u in results]
        seconds = sum(c["n_tokens"][i] for i in computed)
        tokens = {"input": seconds, "output": sum(r["output_tokens"] for r in results.values()), "real": seconds,
                  "padded": out.padded_seconds}
        return RunOutput(table, failures, tokens, codes={valid[u]: code for u, code in codes.items() if u not in places},
                         pieces=_piece_rows(c, valid, sorted(places), results, failed, codes) if places else None)

    def assemble(self, pieces: pa.Table, failed: set[tuple[str, int]]) -> Assembled:
        """Each file staged in pieces, from all of them: one transcript row, or one error row (its
        first failed piece's, or no_speech_found), stitched by runtime/speech/pieces.py."""
        from batchinf.runtime.speech.pieces import missing_pieces, stitch_pieces

        t = pieces.sort_by([("source", "ascending"), ("ordinal", "ascending"), (PIECE, "ascending")])
        src, ordinal = t.column("source").to_pylist(), t.column("ordinal").to_pylist()
        starts = [n for n in range(t.num_rows) if n == 0 or (src[n], ordinal[n]) != (src[n - 1], ordinal[n - 1])]
        batches, results, errors, incomplete, used = [], [], [], {}, 0
        for a, b in zip(starts, starts[1:] + [t.num_rows]):
            if (src[a], ordinal[a]) in failed:
                continue
            rows = t.slice(a, b - a).to_pylist()      # one file's pieces at a time
            gap = missing_pieces(rows)
            if gap is not None:
                incomplete[(src[a], ordinal[a])] = f"record {rows[0]['record_id']!r}: {gap}"
                continue
            used += len(rows)
            got, head = stitch_pieces(rows), {k: rows[0][k] for k in ("record_id", "source", "ordinal")}
            if got.error is not None:
                errors.append({**head, "error": got.error, "message": got.message, "attempts": got.attempts,
                               "piece": got.piece})
                continue
            results.append({**head, **(got.result or {}), "duration_seconds": rows[0]["duration_seconds"],
                            "audio_sha256": rows[0]["audio_sha256"]})
            if len(results) >= 256:
                batches.append(pa.Table.from_pylist(results, schema=TRANSCRIPT_SCHEMA))
                results = []
        batches.append(pa.Table.from_pylist(results, schema=TRANSCRIPT_SCHEMA))
        return Assembled(pa.concat_tables(batches), errors, incomplete, used)

    def renders(self, options: Any) -> tuple[str, ...]:
        return tuple(options.formats)

    def render(self, table: pa.Table, options: Any) -> list[tuple[str, str, bytes]]:
        from batchinf.runtime.speech.subtitles import RENDERERS, subtitle_key

        rows = table.select(["record_id", "segments"]).to_pylist()
        return [(fmt, subtitle_key(fmt, r["record_id"]), RENDERERS[fmt](r["segments"]).encode())
                for fmt in options.formats for r in rows]

    def summarize_plan(self, work: int) -> dict[str, Any]:
        return {"audio_hours": round(work / 3600, 4)}      # the length measure is seconds of audio

    def summarize(self, tables: Iterable[pa.Table]) -> dict[str, Any]:
        total = 0.0
        for t in tables:
            total += float(pa.compute.sum(t.column("duration_seconds")).as_py() or 0.0)
        return {"audio_seconds": round(total, 3)}

    # --- bundles ----------------------------------------------------------------------------
    def detects(self, config: dict[str, Any], src: Path) -> bool:
        from batchinf.tasks.speech_bundle import is_ct2_whisper

        return is_ct2_whisper(config, src)

    def prepare(self, src: Path, tmp: Path) -> Path | None:
        from batchinf.tasks.speech_bundle import prepare_ct2_whisper

        return prepare_ct2_whisper(src, tmp)

    def build_meta(self, src: Path, files: list[str], *, max_length: int | None, dtype: str) -> dict[str, Any]:
        from batchinf.tasks.speech_bundle import build_speech_meta

        return build_speech_meta(src, files, task=self.name, dtype=dtype)

    def open_runtime(self, root: Path, meta: dict[str, Any], device: str) -> Any:
        from batchinf.runtime.speech.runtime import SpeechRuntime

        return SpeechRuntime(root, meta, device)

    def verify_inputs(self, runtime: Any) -> None:
        from batchinf.tasks.speech_bundle import verify_speech_inputs

        verify_speech_inputs(runtime)

    def verify_model(self, runtime: Any) -> None:
        from batchinf.tasks.speech_bundle import verify_speech_tokens

        verify_speech_tokens(runtime)


def _piece_failpoint(record_id: str, piece: int, first: int, at: int, windows: list[tuple[int, int]],
                     rate: int) -> str | None:
    """Failpoint `execute.piece[ID:K]`, hit as piece K of the file whose id is ID starts: `raise`
    fails the piece (its first window, timed in the file) as a window's failure would; None else."""
    if not failpoints.active():
        return None
    try:
        failpoints.hit(f"execute.piece[{record_id}:{piece}]")
    except failpoints.FailpointError as exc:
        a, b = windows[0]
        return f"failed at window {first} ({(at + a) / rate:.2f}-{(at + b) / rate:.2f} s): {type(exc).__name__}: {exc}"
    return None


def _piece_rows(c: dict[str, list[Any]], valid: list[int], pieces: list[int], results: dict[int, dict[str, Any]],
                failed: dict[int, str], codes: dict[int, str]) -> pa.Table:
    """The PIECE_SCHEMA rows of the staged rows at `valid[u]` for u in `pieces`: each piece's
    segments and windows' languages, or its failure (the message as its file's error row says it)."""
    rows = []
    for u in pieces:
        i, r = valid[u], results.get(u)
        rows.append({
            "record_id": c["record_id"][i], "source": c["source"][i], "ordinal": c["ordinal"][i],
            PIECE: c[PIECE][i], "pieces": c["pieces"][i],
            "segments": r["segments"] if r else [], "languages": r["languages"] if r else [],
            "output_tokens": r["output_tokens"] if r else 0, "duration_seconds": c["duration_seconds"][i],
            "audio_sha256": c["audio_sha256"][i], "silent": c["silent"][i],
            "error": None if r else codes.get(u, "inference_error"),
            "message": None if r else f"record {c['record_id'][i]!r}: audio file {c['source'][i]} {failed[u]}",
            "attempts": None})
    return pa.Table.from_pylist(rows, schema=PIECE_SCHEMA)


class SpeechOutcome:
    """transcribe_rows' answer: per file position, its transcript or failure (code, message)."""

    def __init__(self) -> None:
        self.results: dict[int, dict[str, Any]] = {}
        self.failures: dict[int, str] = {}
        self.codes: dict[int, str] = {}
        self.padded_seconds = 0


def _checking_stop(check: Callable[[], None], split: Any) -> Callable[[], None]:
    """`check`, then stop at this batch of windows if the job was cancelled (`split.stop()`)."""
    stop = getattr(split, "stop", None)

    def checked() -> None:
        check()
        if stop is not None and stop():
            raise JobStopped("the job was cancelled")
    return checked


@dataclass
class Clip:
    """Samples [a, b) of file `f`, one of its windows; `packable`: it may share a window with
    others (runtime/speech/packing.py)."""
    f: int
    a: int
    b: int
    packable: bool


@dataclass
class Decoded:
    """A clip's decoding: its segments (times in its file), decoding fields, language and output tokens."""
    segments: list[dict[str, Any]]
    fields: dict[str, Any]
    language: str | None
    tokens: int


def transcribe_rows(runtime: Any, options: Any, samples: list[bytes], windows: list[list[tuple[int, int]]],
                    record_ids: list[str], check: Callable[[], None], packable: list[bool] | None = None,
                    pieces: dict[int, tuple[int, int]] | None = None,
                    file_options: list[Any] | None = None) -> SpeechOutcome:
    """Files (int16 samples, windows) -> transcripts. Every window is a clip; short files
    (`packable`: whole files of one window, `options.pack`) share windows (runtime/speech/packing.py),
    the rest run in batches of `max_batch_windows`, whatever file they come from. A window's text
    depends on no other window (where Whisper stops short of its end, the engine decodes on in
    the same window), so a long file gives the same transcript however its windows are spread
    over pieces and shards. A failing batch is run again in halves until only the failing clips
    fail; a failed clip fails its file with the reason.
    `pieces`: the positions that are pieces of a longer file (their windows relative to their own
    samples) -> (their first window's number, their first sample's place, in the file): their
    windows are numbered and timed in the file, their transcripts list each window's language
    (`languages`), and the no-speech check is left to the whole file (runtime/speech/pieces.py).
    `file_options`: each file's options where records set their own (`options_of`); the windows
    of files with the same options are decoded together."""
    from batchinf.runtime.speech.pieces import NO_SPEECH, majority
    from batchinf.runtime.speech.segments import stitch
    from batchinf.runtime.speech.windows import is_silent

    rate, pieces = runtime.spec.sample_rate, pieces or {}
    per_file = file_options or [options] * len(windows)
    pcm = [np.frombuffer(s, dtype="<i2") for s in samples]
    out = SpeechOutcome()
    whole = [packable is not None and packable[f] and len(w) == 1 and w[0] == (0, pcm[f].size)
             for f, w in enumerate(windows)]
    clips = [Clip(f, a, b, options.pack and whole[f]) for f, wins in enumerate(windows) for a, b in wins]
    groups: dict[int, list[int]] = {}        # the clips of the files of each options object
    for i, c in enumerate(clips):
        groups.setdefault(id(per_file[c.f]), []).append(i)
    done: dict[int, Decoded] = {}
    failed: dict[int, str] = {}
    for idx in groups.values():
        o = per_file[clips[idx[0]].f]
        got, bad = _decode_clips(runtime, decoding_for(runtime, o), o, [clips[i] for i in idx], pcm, record_ids,
                                 check, out)
        done.update((idx[j], v) for j, v in got.items())
        failed.update((idx[j], v) for j, v in bad.items())
    k = 0
    for f, wins in enumerate(windows):
        ids = range(k, k + len(wins))
        k += len(wins)
        first, at = pieces.get(f, (0, 0))
        bad = next((i for i in ids if i in failed), None)
        if bad is not None:
            c = clips[bad]
            out.failures[f] = (f"failed at window {first + bad - ids[0]} ({(at + c.a) / rate:.2f}-"
                               f"{(at + c.b) / rate:.2f} s): {failed[bad]}")
            continue
        text, segments = stitch([((at + clips[i].a) / rate, [_moved(s, at / rate) for s in done[i].segments],
                                  done[i].fields) for i in ids])
        if not text and f not in pieces and not is_silent(pcm[f].astype(np.float32) / 32768.0, rate):
            out.failures[f] = NO_SPEECH
            out.codes[f] = "no_speech_found"
            continue
        langs = [done[i].language for i in ids]
        out.results[f] = {"text": text, "segments": segments, "language": majority(langs),
                          "output_tokens": sum(done[i].tokens for i in ids), **({"languages": langs} if f in pieces else {})}
    return out


def _decode_clips(runtime: Any, d: Any, options: Any, clips: list[Clip], pcm: list[np.ndarray],
                  record_ids: list[str], check: Callable[[], None],
                  out: SpeechOutcome) -> tuple[dict[int, Decoded], dict[int, str]]:
    """Clips -> ({clip: Decoded}, {clip: why it failed}): packable ones laid end to end in shared
    windows first (`_decode_packs`), then every clip left alone, in batches of `max_batch_windows`."""
    spec = runtime.spec
    audio = [pcm[c.f][c.a:c.b] for c in clips]
    done: dict[int, Decoded] = {}
    failed: dict[int, str] = {}
    if any(c.packable for c in clips):
        _decode_packs(runtime, d, options, clips, audio, done, record_ids, check, out)
    alone = [i for i in range(len(clips)) if i not in done]

    def run(batch: list[int]) -> None:
        check()
        hit_record_failpoints(sorted({record_ids[clips[i].f] for i in batch}))
        got = _decode(runtime, d, options, [audio[i] for i in batch], [clips[i].a for i in batch])
        done.update(zip(batch, got))
        out.padded_seconds += len(batch) * spec.chunk_seconds
        runtime.progress_done += sum(audio[i].size for i in batch) / spec.sample_rate

    step = options.max_batch_windows
    for i in range(0, len(alone), step):
        isolate(run, alone[i:i + step], done=done.__contains__, failed=failed.__setitem__)
    return done, failed


def _decode_packs(runtime: Any, d: Any, options: Any, clips: list[Clip], audio: list[np.ndarray],
                  done: dict[int, Decoded], record_ids: list[str], check: Callable[[], None],
                  out: SpeechOutcome) -> None:
    """Decode the packable clips in packs (runtime/speech/packing.py) and add what each pack gives
    its clips to `done`. A clip whose pack failed, whose split was unsure, or whose pack left a
    clip with sound without text (the pack's decoding is not trusted) is left to be decoded alone."""
    from batchinf.runtime.speech.packing import as_one_segment, pack_files, pack_samples, split_pack
    from batchinf.runtime.speech.windows import is_silent

    spec, rate = runtime.spec, runtime.spec.sample_rate
    gap = int(GAP_SECONDS * rate)
    packs, _ = pack_files([x.size for x in audio], [c.packable for c in clips], spec.chunk_samples, gap)
    decoded: set[int] = set()
    d_pack = replace(d, timestamps=True)       # packs are split by their timestamps

    def accept(k: int, r: Decoded) -> None:
        mine, _ = split_pack(packs[k], r.segments, rate, gap)
        if any(not segs and not is_silent(audio[i].astype(np.float32) / 32768.0, rate) for i, segs in mine.items()):
            return
        for i, segs in mine.items():
            if not d.timestamps:
                segs = as_one_segment(segs, audio[i].size / rate)
            at = clips[i].a / rate
            done[i] = Decoded([_moved(s, at) for s in segs], r.fields, r.language, sum(len(s["tokens"]) + 2 for s in segs))
            runtime.progress_done += audio[i].size / rate

    def run(batch: list[int]) -> None:
        check()
        hit_record_failpoints(sorted({record_ids[clips[i].f] for k in batch for i in packs[k].files}))
        wins = [pack_samples(packs[k], audio) for k in batch]
        for k, r in zip(batch, _decode(runtime, d_pack, options, wins, [0] * len(wins))):
            decoded.add(k)
            accept(k, r)
        out.padded_seconds += len(batch) * spec.chunk_seconds

    step = options.max_batch_windows
    for i in range(0, len(packs), step):
        isolate(run, list(range(i, min(i + step, len(packs)))), done=decoded.__contains__, failed=lambda k, _: None)


def _moved(s: dict[str, Any], by: float) -> dict[str, Any]:
    if not by:
        return s
    out = {**s, "start": round(s["start"] + by, 3), "end": round(s["end"] + by, 3)}
    if s.get("words") is not None:
        out["words"] = [{**w, "start": round(w["start"] + by, 3), "end": round(w["end"] + by, 3)} for w in s["words"]]
    return out


def _decode(runtime: Any, d: Any, options: Any, audio: list[np.ndarray], starts: list[int]) -> list[Decoded]:
    """Windows' int16 samples, each starting at sample `starts[i]` of its file -> each one's
    Decoded (times in the file)."""
    from batchinf.runtime.speech.features import batch_features
    from batchinf.runtime.speech.segments import window_segments
    from batchinf.runtime.speech.windows import sound_end
    from batchinf.runtime.speech.words import attach_words

    engine, spec = runtime.engine, runtime.spec
    rate = spec.sample_rate
    floats = [a.astype(np.float32) / 32768.0 for a in audio]
    feats = batch_features(floats, spec)
    results, langs = engine.generate(feats, d, [sound_end(x, rate) for x in floats])
    words: list[Any] = [None] * len(audio)
    if options.timestamps == "word":
        words = engine.words(feats, results, [a.size // spec.hop for a in audio], langs, d.task)
    out = []
    for r, lang, ws, a, x in zip(results, langs, words, starts, audio):
        silent = r.no_speech_prob > d.no_speech_threshold and r.avg_logprob < d.logprob_threshold
        segs = [] if silent else window_segments(r.tokens, engine.eot, engine.timestamp_begin, a / rate,
                                                 (a + x.size) / rate, engine.decode_text)
        if ws is not None:
            attach_words(segs, ws, a / rate)
        fields = {"temperature": r.temperature, "avg_logprob": r.avg_logprob,
                  "compression_ratio": r.compression_ratio, "no_speech_prob": r.no_speech_prob}
        out.append(Decoded(segs, fields, lang, len(r.tokens)))
    return out
