"""Encoder tokens/s by batch token budget, in one process, on 2,500 records of the throughput
benchmark's corpus (sorted by length, as batchinf shards are):

    python benchmarks/encoder_batching.py --threads 2
    python benchmarks/encoder_batching.py --threads 1 & python benchmarks/encoder_batching.py --threads 1

The second line shows what batchinf's default pool (one process per core, one thread each)
gets in aggregate against one two-thread process. `--plain-too` also times the model without
its oneDNN-prepacked projections (BATCHINF_PACK_WEIGHTS=0), batch for batch beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.embed_throughput import make_corpus, minilm_dir, read_texts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budgets", default="512,1024,2048,4096,8192")
    ap.add_argument("--records", type=int, default=2500)
    ap.add_argument("--plain-too", action="store_true", help="also without prepacked weights, interleaved")
    args = ap.parse_args()

    import torch

    from batchinf.config import settings
    from batchinf.tasks.batching import token_budget_batches
    from batchinf.runtime.encoder import embed_batch, load_encoder
    from batchinf.runtime.tokenizer import TextTokenizer

    torch.set_num_threads(args.threads)
    corpus = Path(tempfile.mkdtemp()) / "corpus.jsonl"
    make_corpus(corpus, args.records)
    tok = TextTokenizer.from_file(minilm_dir() / "tokenizer.json", 256)
    ids = sorted((e.ids for e in tok.encode_batch(read_texts(corpus))), key=len)
    models = {"prepacked": load_encoder(minilm_dir())}
    if args.plain_too:
        os.environ["BATCHINF_PACK_WEIGHTS"] = "0"
        settings.cache_clear()
        models["plain"] = load_encoder(minilm_dir())
    real = sum(map(len, ids))
    for budget in (int(b) for b in args.budgets.split(",")):
        batches = token_budget_batches([len(x) for x in ids], budget)
        seconds = dict.fromkeys(models, 0.0)
        for b in batches:
            for name, model in models.items():
                if b is batches[0]:
                    embed_batch(model, [ids[i] for i in b], tok.pad_id, "mean", True)   # warm-up
                t0 = time.perf_counter()
                embed_batch(model, [ids[i] for i in b], tok.pad_id, "mean", True)
                seconds[name] += time.perf_counter() - t0
        rates = "  ".join(f"{name} {real / t:7.0f}" for name, t in seconds.items())
        ratio = f"  ratio {seconds['plain'] / seconds['prepacked']:.3f}" if args.plain_too else ""
        print(f"threads={args.threads} budget={budget:5d}: tokens/s {rates}{ratio} ({len(batches)} batches)",
              flush=True)


if __name__ == "__main__":
    main()
