"""The Ray Data peer of benchmarks/embed_peers.py: JSONL in, Parquet out, one sentence-transformers
actor per core (one torch thread each), batches of 64.

    python ray_embed_script.py MODEL_DIR IN.jsonl OUT_DIR CORES"""
import sys

import numpy as np


class Embedder:
    def __init__(self, model_dir: str) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(1)
        self.model = SentenceTransformer(model_dir, device="cpu")
        self.model.max_seq_length = 256

    def __call__(self, batch: dict) -> dict:
        vectors = self.model.encode(list(batch["text"]), batch_size=64, convert_to_numpy=True)
        return {"id": batch["id"], "embedding": list(np.asarray(vectors, dtype=np.float32))}


def main(model_dir: str, src: str, dst: str, cores: int) -> None:
    import ray

    # one logical CPU more than the actors hold: the read and write tasks need a slot beside them
    ray.init(num_cpus=cores + 1, include_dashboard=False, log_to_driver=False)
    ds = ray.data.read_json(src).map_batches(Embedder, fn_constructor_args=(model_dir,), concurrency=cores,
                                             batch_size=64, num_cpus=1)
    ds.write_parquet(dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
