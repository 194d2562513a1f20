"""The openai-http engine against a plain asyncio client, both driving the same llama.cpp
`llama-server` (built from the llama-cpp-python sdist, tests/helpers/llama_quantize.py) serving the
SmolLM2-135M-Instruct Q4_1 GGUF on loopback, with the same prompts (the bundle's chat template and
tokenizer: token ids), the same greedy params and the same concurrency, side by side in one run with
the repetitions alternating (A B C A B C ...):
  (A) a plain client: httpx.AsyncClient, a semaphore of --concurrency, one POST /v1/completions each;
  (B) the engine's runtime in this process (HttpGenerateRuntime.generate: retries, accounting, result
      rows): the engine's own per-request overhead;
  (C) a whole `batchinf` job on the engine (submit, plan, a worker process that replays the fixtures,
      commits its shards, verification and publish): what durability costs end to end.
Reported: medians of wall seconds and completions/s, each contender's overhead against (A) as the
ratio of medians and as the median of each repetition's own ratio against the (A) run just before it
(paired: on a shared, noisy machine the load drifts between repetitions far more than within one),
and whether B's and C's answers equal A's (the server is greedy and deterministic per slot). Also the
client's own CPU seconds per request (this process and its worker processes, not the server's): what
each contender costs on the client whatever the load, which wall time on a shared machine cannot show.

    python benchmarks/engine_openai_http.py [--prompts 128] [--max-tokens 32] [--reps 3] [--no-job] [--json]
    python benchmarks/engine_openai_http.py --short --json      # CI: 16 prompts, one repetition each
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.prompts import questions  # noqa: E402 -- after the path insert


async def plain(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[str]:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one(ids: list[int]) -> str:
            async with gate:
                r = await client.post("/completions", json={"model": model, "prompt": ids, "max_tokens": max_tokens,
                                                            "temperature": 0.0, "top_p": 1.0, "seed": 0})
                r.raise_for_status()
                return r.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def _cpu_seconds() -> float:
    """User and system CPU of this process and of its children that ended (a job's worker processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--slots", type=int, default=4, help="llama-server's parallel slots")
    ap.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-job", action="store_true", help="leave out (C), the whole job: A and B alternate")
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.short:
        a.prompts, a.max_tokens, a.reps = 16, 8, 1

    import os

    from tests.helpers.llama_server import MODEL, LlamaServer
    from tests.helpers.real_models import smollm2_gguf

    tmp = Path(tempfile.mkdtemp(prefix="bench-openai-http-"))
    os.environ["BATCHINF_HOME"] = str(tmp / "home")
    for name in ("BATCHINF_DATABASE_URL", "BATCHINF_BUNDLE_STORE"):
        os.environ.pop(name, None)
    from batchinf.bundles import import_gguf, open_runtime
    from batchinf.controller import drive
    from batchinf.engines.openai_http import endpoint_spec
    from batchinf.ledger.jobs import get as job_row
    from batchinf.manifest import parse_manifest
    from batchinf.parts import read_table
    from batchinf.runtime.generation.sampling import SamplingParams
    from batchinf.runtime.generation.seq import GenRequest
    from batchinf.scopes import Caller
    from batchinf.submit import submit
    from batchinf.verify import MANIFEST

    server = LlamaServer(smollm2_gguf(), tmp / "llama-server.log", slots=a.slots, threads=a.threads)
    server.start()
    try:
        spec = endpoint_spec(server.base_url, MODEL, concurrency=a.concurrency)
        digest = import_gguf(smollm2_gguf(), "smollm2", alias="http", endpoint=spec).digest
        runtime = open_runtime(digest, engine="openai-http")   # the engine (its fixtures replayed here)
        qs = questions(a.prompts, kinds=4, numbered=True)
        prompts = [runtime.encode_chat([{"role": "user", "content": q}]) for q in qs]
        inp = tmp / "prompts.jsonl"
        inp.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                               for i, q in enumerate(qs)))
        asyncio.run(plain(server.base_url, MODEL, prompts[:2], 2, 2))     # warm the server

        def run_plain() -> list[str]:
            return asyncio.run(plain(server.base_url, MODEL, prompts, a.max_tokens, a.concurrency))

        def run_engine() -> list[str]:
            reqs = [GenRequest(i, p, SamplingParams(max_tokens=a.max_tokens)) for i, p in enumerate(prompts)]
            got = {r.key: r.text for r in runtime.generate(reqs, max_batch_tokens=1 << 20)}
            return [got[i] for i in range(len(prompts))]

        def run_job(rep: int) -> list[str]:
            out = tmp / "out" / f"r{rep}"
            raw = {"name": f"bench-{rep}", "task": "generate", "bundle": "smollm2@http",
                   "input": {"uri": str(inp), "messages_field": "messages"}, "output": {"uri": str(out)},
                   "shards": {"max_records": max(1, a.prompts // 2)}, "options": {"max_tokens": a.max_tokens}}
            job_id, _ = submit(parse_manifest(raw), Caller("default", operator=True))
            assert drive(job_id, workers=1, threads=1) == "succeeded", job_row(job_id).error
            m = json.loads((out / MANIFEST).read_text())
            rows = {r["record_id"]: r["text"] for p in m["parts"] if p["kind"] == "results"
                    for r in read_table(str(out / p["key"])).to_pylist()}
            return [rows[f"q{i}"] for i in range(a.prompts)]

        contenders = {"plain asyncio client": lambda rep: run_plain(), "openai-http engine (in process)":
                      lambda rep: run_engine(), "batchinf job on openai-http (end to end)": run_job}
        if a.no_job:
            del contenders["batchinf job on openai-http (end to end)"]
        seconds: dict[str, list[float]] = {k: [] for k in contenders}
        cpu: dict[str, list[float]] = {k: [] for k in contenders}
        answers: dict[str, list[str]] = {}
        order = ""
        for rep in range(a.reps):
            for k, fn in contenders.items():
                t0, c0 = time.perf_counter(), _cpu_seconds()
                answers[k] = fn(rep)
                seconds[k].append(time.perf_counter() - t0)
                cpu[k].append(_cpu_seconds() - c0)
                order += k[0].upper() + " "
    finally:
        server.stop()

    base = statistics.median(seconds["plain asyncio client"])
    report: dict[str, Any] = {
        "prompts": a.prompts, "max_tokens": a.max_tokens, "concurrency": a.concurrency, "slots": a.slots,
        "reps": a.reps, "order": order,
        "seconds": {k: statistics.median(v) for k, v in seconds.items()},
        "seconds_each": seconds,
        "completions_per_s": {k: a.prompts / statistics.median(v) for k, v in seconds.items()},
        "overhead_vs_plain": {k: statistics.median(v) / base - 1 for k, v in seconds.items() if k != "plain asyncio client"},
        "client_cpu_ms_per_request": {k: 1000 * statistics.median(v) / a.prompts for k, v in cpu.items()},
        "overhead_paired": {k: statistics.median(x / y - 1 for x, y in zip(v, seconds["plain asyncio client"]))
                            for k, v in seconds.items() if k != "plain asyncio client"},
        "same_answers_as_plain": {k: sum(x == y for x, y in zip(v, answers["plain asyncio client"]))
                                  for k, v in answers.items() if k != "plain asyncio client"},
    }
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        for k, s in report["seconds"].items():
            extra = (f"  overhead {report['overhead_vs_plain'][k]:+.1%} (paired median {report['overhead_paired'][k]:+.1%})"
                     if k in report["overhead_vs_plain"] else "")
            print(f"{k:45s} {s:8.2f} s  {report['completions_per_s'][k]:7.2f} completions/s{extra}")
        print("client CPU ms per request:", {k: round(v, 2) for k, v in report["client_cpu_ms_per_request"].items()})
        print("same answers as the plain client:", report["same_answers_as_plain"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
