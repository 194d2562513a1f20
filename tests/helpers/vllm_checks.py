"""The vllm engine's checks, run inside the vllm venv (tests/helpers/vllm_env.py) by
tests/integration/test_vllm_engine.py, in one process so vLLM loads once: prints one JSON object.

On a tiny random Llama (head_dim 64, which vLLM's CPU attention supports), imported as a bundle:
- the bundle opens on the vllm engine (its greedy fixtures replayed through vLLM at load);
- greedy token ids equal transformers' on the same weights;
- a seeded sampled record gives the same tokens alone and inside a batch (what a retry or a split
  of its shard does), and differs for another seed;
- a json_schema response_format gives JSON that the schema accepts;
- a job with `engine: vllm` runs end to end in a worker process and equals the native job's answers
  where greedy; a seeded sampled one whose worker is killed after writing a shard gives every
  record once, with the same tokens as a clean run.

    python -m tests.helpers.vllm_checks HOME_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

PROMPTS = ["the people of the world", "water and light", "every day of the year", "make the world",
           "light of the people", "the year of water"]


def main(home: Path) -> dict[str, Any]:
    os.environ["BATCHINF_HOME"] = str(home)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")      # GiB: the tiny model needs little
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for name in ("BATCHINF_DATABASE_URL", "BATCHINF_BUNDLE_STORE"):
        os.environ.pop(name, None)
    import torch

    from batchinf.bundles import import_bundle, open_runtime
    from batchinf.controller import drive
    from batchinf.ledger.jobs import get as job_row
    from batchinf.manifest import parse_manifest
    from batchinf.parts import read_table
    from batchinf.runtime.generation.sampling import SamplingParams
    from batchinf.runtime.generation.seq import GenRequest
    from batchinf.scopes import Caller
    from batchinf.submit import submit
    from batchinf.verify import MANIFEST
    from tests.helpers.tiny_llama import make_tiny_llama

    report: dict[str, Any] = {}
    model_dir = make_tiny_llama(home.parent / "tiny", hidden=128, heads=2, kv_heads=1, intermediate=256)
    digest = import_bundle(model_dir, "tiny", alias="prod").digest
    rt = open_runtime(digest, engine="vllm")            # fixtures replayed through vLLM here
    report["engine"] = rt.engine

    # greedy token ids against transformers on the same weights
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [rt.encode_prompt(p) for p in PROMPTS]
    ours = {r.key: r.token_ids for r in rt.generate([GenRequest(i, p, SamplingParams(max_tokens=12))
                                                     for i, p in enumerate(prompts)])}
    equal = 0
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=list(rt.eos_ids),
                              pad_token_id=rt.eos_ids[0])[0, len(p):].tolist()
        ref = out[:-1] if out and out[-1] in rt.eos_ids else out
        equal += ref == ours[i]
    report["greedy_equal_transformers"] = [equal, len(prompts)]

    # seeded sampling: the same record alone and among others, and another seed
    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.95, seed=seed)

    alone = next(iter(rt.generate([GenRequest(0, prompts[0], sampled(123))]))).token_ids
    batch = {r.key: r.token_ids for r in rt.generate([GenRequest(i, p, sampled(123 if i == 0 else 7 + i))
                                                      for i, p in enumerate(prompts)])}
    other = next(iter(rt.generate([GenRequest(0, prompts[0], sampled(124))]))).token_ids
    report["seeded_alone_equals_in_batch"] = alone == batch[0]
    report["another_seed_differs"] = alone != other

    # structured output
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = json.dumps({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}, sort_keys=True)
    res = next(iter(rt.generate([GenRequest(0, prompts[1], SamplingParams(max_tokens=48, response_format=fmt))])))
    try:
        value = json.loads(res.text)
        import jsonschema

        jsonschema.validate(value, schema)
        report["structured_valid"] = True
    except Exception as exc:  # noqa: BLE001 -- reported
        report["structured_valid"] = f"{type(exc).__name__}: {exc}: {res.text!r} ({res.finish_reason})"

    # a job on the vllm engine, end to end, against the same job on native
    inp = home.parent / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    # and a seeded sampled job on vllm whose first worker is killed after writing a shard (the shard is
    # retried in a new worker process, which loads vLLM again): the same bytes as a clean run
    from sqlalchemy import select

    from batchinf.ledger.db import tx
    from batchinf.ledger.tables import attempts, shards

    answers = {}
    sampled = {"max_tokens": 10, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 5}
    for name, engine, options, crash in (("vllm", "vllm", {"max_tokens": 10}, False),
                                         ("native", "native", {"max_tokens": 10}, False),
                                         ("vllm_sampled", "vllm", sampled, False), ("vllm_killed", "vllm", sampled, True)):
        out = home.parent / "out" / name
        raw = {"name": name, "task": "generate", "bundle": "tiny@prod", "engine": engine,
               "input": {"uri": str(inp)}, "output": {"uri": str(out)}, "shards": {"max_records": 3},
               "options": options}
        job_id, _ = submit(parse_manifest(raw), Caller("default", operator=True))
        if crash:
            os.environ["BATCHINF_FAILPOINTS"] = "execute.after_write=crash"
        final = drive(job_id, workers=1, threads=1, on_tick=lambda: os.environ.pop("BATCHINF_FAILPOINTS", None))
        report[f"job_{name}"] = final if final == "succeeded" else f"{final}: {job_row(job_id).error}"
        if crash:
            with tx() as conn:
                report["killed_attempts_lost"] = len(conn.execute(
                    select(attempts.c.number).join(shards, shards.c.id == attempts.c.shard_id)
                    .where(shards.c.job_id == job_id, attempts.c.status == "lost")).scalars().all())
        if final == "succeeded":
            m = json.loads((out / MANIFEST).read_text())
            answers[name] = {r["record_id"]: r["output_ids"] for p in m["parts"] if p["kind"] == "results"
                             for r in read_table(str(out / p["key"])).to_pylist()}
    # cancel mid-job: one record a shard, each shard's worker slowed after writing; cancelled once one
    # shard committed, the job ends cancelled with a _PARTIAL.json naming what was done
    import threading
    import time

    from batchinf.controller import cancel
    from batchinf.ledger.status import status

    out = home.parent / "out" / "cancelled"
    raw = {"name": "cancelled", "task": "generate", "bundle": "tiny@prod", "engine": "vllm",
           "input": {"uri": str(inp)}, "output": {"uri": str(out)}, "shards": {"max_records": 1},
           "options": {"max_tokens": 10}}
    job_id, _ = submit(parse_manifest(raw), Caller("default", operator=True))
    os.environ["BATCHINF_FAILPOINTS"] = "execute.after_write=sleep(1.5)"
    final_status: list[str] = []
    driver = threading.Thread(target=lambda: final_status.append(drive(job_id, workers=1, threads=1)))
    driver.start()
    deadline = time.monotonic() + 300
    while status(job_id)["shards"]["committed"] < 1 and time.monotonic() < deadline and driver.is_alive():
        time.sleep(0.2)
    cancel(job_id, finish=False)
    driver.join(300)
    os.environ.pop("BATCHINF_FAILPOINTS", None)
    partial = out / "_PARTIAL.json"
    report["cancelled"] = {"status": final_status[0] if final_status else None, "partial": partial.is_file(),
                           "committed": status(job_id)["shards"]["committed"]}
    if "vllm" in answers and "native" in answers:
        report["job_vllm_equals_native"] = [sum(answers["vllm"][k] == v for k, v in answers["native"].items()),
                                            len(answers["native"])]
    if "vllm_sampled" in answers and "vllm_killed" in answers:
        report["killed_equals_clean"] = answers["vllm_sampled"] == answers["vllm_killed"]
        report["killed_records"] = len(answers["vllm_killed"])
    return report


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
