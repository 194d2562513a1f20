"""What rendering chat templates in a sandbox process costs, and what the bombs it stops reach.

Render cost: N chat records (a system prompt, zero to two user/assistant exchanges, then a user
message; 20-80 words each) rendered with SmolLM2-135M-Instruct's template (from the GGUF ./dev/test downloads; the
tiny test model's ChatML template when it is missing), median of --reps repetitions of:
  (A) in process, as before: `chat_template.render` of the template compiled once;
  (B) the sandbox, one record per round trip (`TemplateSandbox.render([m])`);
  (C) the sandbox, RENDER_CHUNK records per round trip;
and, with SmolLM2's tokenizer, render + tokenize as staging does it: in process (before), and through
the sandbox with the next chunk rendering while one is tokenized (`chat_results`, Generate.stage).
Every output must equal the in-process one. The sandbox's start (a fresh interpreter compiling
the template) is reported apart.

Bombs: each of tests/helpers/template_bombs.py in a fresh sandbox at --memory-bytes and --seconds
(default: Settings' defaults): seconds until the record's error and the process's peak RSS (VmHWM,
sampled every 5 ms while it runs, so a process the kernel stops for its CPU time is counted too).

    python benchmarks/chat_template_sandbox.py [--records 1000] [--reps 5] [--json]
    python benchmarks/chat_template_sandbox.py --short --json       # 50 records, 3 bombs
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchinf.config import settings  # noqa: E402
from batchinf.runtime.chat_template import compile_template, render  # noqa: E402
from batchinf.runtime.template_sandbox import TemplateSandbox, chat_results, peak_rss_of  # noqa: E402
from batchinf.tasks.generate import RENDER_CHUNK  # noqa: E402
from tests.helpers.template_bombs import BOMBS  # noqa: E402
from tests.helpers.tiny_llama import CHAT_TEMPLATE  # noqa: E402

WORDS = ("time year people way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government").split()
VARIABLES = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": None, "unk_token": None}


def template() -> tuple[str, str, Any]:
    """The template's name, its source and its tokenizer (None without SmolLM2's GGUF)."""
    from tests.helpers.real_models import SMOLLM2_GGUF

    if not SMOLLM2_GGUF.is_file():
        return "tiny ChatML (SmolLM2's GGUF is missing)", CHAT_TEMPLATE, None
    from batchinf.runtime.gguf import GGUFFile
    from batchinf.runtime.gguf_vocab import build_tokenizer

    with GGUFFile(SMOLLM2_GGUF) as g:
        return "SmolLM2-135M-Instruct", g.metadata["tokenizer.chat_template"], build_tokenizer(g.metadata)


def conversations(n: int) -> list[list[dict[str, str]]]:
    rng = random.Random(7)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80)))

    out = []
    for _ in range(n):
        turns = [{"role": "system", "content": "You answer in one short paragraph."}]
        for _ in range(rng.randint(0, 2)):
            turns += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        out.append(turns + [{"role": "user", "content": text()}])
    return out


def render_cost(source: str, tokenizer: Any, convs: list[list[dict]], reps: int, limits: dict[str, Any]
                ) -> dict[str, Any]:
    compiled = compile_template(source)
    want = [render(compiled, messages=m, add_generation_prompt=True, **VARIABLES) for m in convs]
    sandbox = TemplateSandbox(source, VARIABLES, **limits)
    t0 = time.perf_counter()
    sandbox.render(convs[:1])
    start = time.perf_counter() - t0

    def in_process() -> list[str]:
        return [render(compiled, messages=m, add_generation_prompt=True, **VARIABLES) for m in convs]

    def one_per_trip() -> list[Any]:
        return [sandbox.render([m])[0] for m in convs]

    def chunked() -> list[Any]:
        return [r for i in range(0, len(convs), RENDER_CHUNK) for r in sandbox.render(convs[i:i + RENDER_CHUNK])]

    def encode(texts: Any) -> list[Any]:
        return [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]

    def in_process_tokenized() -> list[Any]:
        return encode(render(compiled, messages=m, add_generation_prompt=True, **VARIABLES) for m in convs)

    def staging_tokenized() -> list[Any]:       # as Generate.stage: the next chunk renders while one is tokenized
        chunks = (convs[i:i + RENDER_CHUNK] for i in range(0, len(convs), RENDER_CHUNK))
        return [ids for results in chat_results(sandbox, chunks, Path("tokenizer_config.json")) for ids in encode(results)]

    contenders = {"in process (before)": in_process, "sandbox, 1 record per round trip": one_per_trip,
                  f"sandbox, {RENDER_CHUNK} records per round trip": chunked}
    if tokenizer is not None:
        encode(want[:10])               # the tokenizer's first call builds its caches
        contenders |= {"render + tokenize, in process (before)": in_process_tokenized,
                       f"render + tokenize, sandbox ({RENDER_CHUNK} per trip, one ahead: staging)": staging_tokenized}
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(reps):               # alternating, so that a drifting machine load weighs on all
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            got = fn()
            seconds[name].append(time.perf_counter() - t0)
            if got != (want if len(got) == len(want) and isinstance(got[0], str) else encode(want)):
                raise SystemExit(f"{name}: the output differs from the in-process renderer's")
    per_s = {name: len(convs) / statistics.median(s) for name, s in seconds.items()}
    base = {k: per_s["render + tokenize, in process (before)" if k.startswith("render + tokenize") else "in process (before)"]
            for k in per_s}
    sandbox.close()
    return {"sandbox_start_s": round(start, 3), "records_per_s": {k: round(v) for k, v in per_s.items()},
            "us_per_record": {k: round(1e6 / v, 1) for k, v in per_s.items()},
            "relative_to_in_process": {k: round(v / base[k], 2) for k, v in per_s.items()}}


def bomb(name: str, limits: dict[str, Any]) -> dict[str, Any]:
    sandbox = TemplateSandbox(BOMBS[name], {}, **limits)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            pid = sandbox.pid
            if pid:
                peak[0] = max(peak[0], peak_rss_of(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        (result,) = sandbox.render([[{"role": "user", "content": "x"}]])
    except Exception as exc:  # noqa: BLE001 -- a bomb at compile time (none of these) is its own result
        result = exc
    elapsed = time.perf_counter() - t0
    done.set()
    sampler.join()
    peak_bytes = max(peak[0], sandbox.peak_rss())
    sandbox.close()
    return {"seconds": round(elapsed, 2), "peak_rss_mib": round(peak_bytes / 2**20, 1),
            "under_limit": peak_bytes <= limits["memory_bytes"], "stopped": isinstance(result, Exception),
            "error": str(result)[:160]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--memory-bytes", type=int, default=settings().template_memory_bytes)
    ap.add_argument("--seconds", type=float, default=settings().template_seconds)
    ap.add_argument("--short", action="store_true", help="50 records, 1 repetition, 3 bombs (CI)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.short:
        a.records, a.reps = 50, 1
    limits = {"memory_bytes": a.memory_bytes, "seconds": a.seconds}
    name, source, tokenizer = template()
    convs = conversations(a.records)
    report = {"template": name, "records": a.records, "reps": a.reps, "limits": limits,
              "render": render_cost(source, tokenizer, convs, a.reps, limits),
              "bombs": {b: bomb(b, limits) for b in (list(BOMBS)[:3] if a.short else BOMBS)}}
    ok = all(b["stopped"] and b["under_limit"] for b in report["bombs"].values())
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        r = report["render"]
        print(f"{a.records} chat records, template {name}, median of {a.reps}; sandbox start {r['sandbox_start_s']} s")
        for k, v in r["records_per_s"].items():
            print(f"  {k:62s} {v:8d} records/s  {r['us_per_record'][k]:7.1f} us/record  x{r['relative_to_in_process'][k]}")
        print(f"bombs at {a.memory_bytes} bytes, {a.seconds:g} s:")
        for k, v in report["bombs"].items():
            print(f"  {k:20s} {v['seconds']:6.2f} s  peak RSS {v['peak_rss_mib']:6.1f} MiB  {v['error'][:90]}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
