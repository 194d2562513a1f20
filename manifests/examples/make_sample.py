"""Write manifests/examples/sample.jsonl: 2,000 records of varied length plus a few bad lines,
so the demo shows error rows. Deterministic; run it again to regenerate the shipped file."""

from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = ["The ledger", "A worker", "The planner", "Every shard", "The verifier", "An operator",
            "The bundle", "A nightly job", "The controller", "Object storage"]
VERBS = ["records", "checks", "embeds", "retries", "pins", "publishes", "buckets", "tokenizes",
         "commits", "reads"]
OBJECTS = ["each input record exactly once", "the model digest before the first batch",
           "records of similar token length", "a manifest after verification",
           "the version of every input object", "a shard whose lease expired",
           "error rows for malformed lines", "batches by token budget"]


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."


def main(n: int = 2000, seed: int = 42) -> None:
    rng = random.Random(seed)
    path = Path(__file__).with_name("sample.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            k = min(60, max(1, int(rng.paretovariate(1.4))))   # heavy tail of long documents
            f.write(json.dumps({"id": f"doc-{i:05d}", "text": " ".join(sentence(rng) for _ in range(k))}) + "\n")
        f.write('{"id": "doc-broken", "text": "an unterminated string}\n')
        f.write(json.dumps({"id": "doc-empty", "text": ""}) + "\n")
        f.write(json.dumps({"text": "a record without an id"}) + "\n")
    print(f"wrote {n + 3} lines to {path}")


if __name__ == "__main__":
    main()
