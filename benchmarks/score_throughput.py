"""Task score against sentence-transformers' CrossEncoder.predict: pairs/s and padding
efficiency (real / computed token positions) on the same heavy-tailed pair-length corpus, one
run each, same threads, same random-weight MiniLM-sized BERT cross-encoder (6 layers, hidden
384, written by transformers; no download):

    python benchmarks/score_throughput.py --threads 2 --pairs 1000 --reps 3
    python benchmarks/score_throughput.py --short      # 200 pairs, 1 rep (no warm-up): CI runs it for correctness

batchinf runs the pairs as its score task does (tokenized once, then run_units: sorted by pair
length, token-budget batches of `--budget` padded tokens at the task's minimum fill);
CrossEncoder.predict runs them in batches of `--batch-size` (its default 32), padding each batch
to its longest pair, in its own order (sentence-transformers >= 5 sorts by character length;
older versions keep the input order). Each side's time covers tokenization and the forwards.
The two alternate (ABBA ABBA ...) for `--reps` repetitions each after one untimed warm-up run
each, and the report gives each side's median, so load from other processes that comes and goes
hits both sides alike; each side's fastest repetition (the least disturbed) is reported too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ("the of and to a in is it you that he was for on are with as his they be at one have this from or "
         "had by word but what some we can out other were all there when up use your how said an each").split()


def corpus(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Short queries; documents whose word counts follow a Pareto tail (most short, a few long)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        q = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 12))))
        d = " ".join(rng.choice(WORDS, size=int(min(400, 8 + rng.pareto(1.3) * 25))))
        out.append((q, d))
    return out


def model_dir(root: Path) -> Path:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from tests.helpers.tiny_models import _build_tokenizer, _vocab

    tok = _build_tokenizer(_vocab(None))
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                     intermediate_size=1536, max_position_embeddings=512, num_labels=1)
    BertForSequenceClassification(cfg).eval().save_pretrained(root, safe_serialization=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizerFast", "model_max_length": 512, "pad_token": "[PAD]", "unk_token": "[UNK]",
        "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}))
    return root


def predict_order(ce: object, pairs: list[tuple[str, str]]) -> list[int]:
    """The order CrossEncoder.predict runs pairs in: sentence-transformers >= 5 sorts them by
    character length, longest first (its private helpers, used here only to count its padding);
    older versions keep the input order."""
    length = getattr(ce, "_input_length", None)
    if length is None:
        return list(range(len(pairs)))
    order = np.argsort([-length(p) for p in pairs])
    if getattr(ce, "_can_flatten_inputs", lambda: False)():
        order = ce._interleave_sorted_indices(order)  # type: ignore[attr-defined]
    return [int(i) for i in order]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per side, alternating")
    ap.add_argument("--short", action="store_true", help="200 pairs, 1 rep, no warm-up (CI: correctness, not timing)")
    ap.add_argument("--json", action="store_true", help="accepted for symmetry; the report is always JSON")
    args = ap.parse_args()
    if args.short:
        args.pairs, args.reps = 200, 1

    import torch
    from sentence_transformers import CrossEncoder

    from batchinf.runtime.bundle import bundle_files
    from batchinf.runtime.classifier import ClassifierRuntime, activate
    from batchinf.tasks.batching import run_units
    from batchinf.tasks.classifier_bundle import build_classifier_meta
    from batchinf.tasks.score import MIN_FILL

    torch.set_num_threads(args.threads)
    src = model_dir(Path(tempfile.mkdtemp()) / "ce")
    pairs = corpus(args.pairs)
    meta = build_classifier_meta(src, bundle_files(src), task="score", max_length=512, dtype="float32",
                                 fixture_inputs=[("a", "b")])
    rt = ClassifierRuntime(src, meta)
    rt.load_model()
    ce = CrossEncoder(str(src), device="cpu", max_length=512)

    def ours() -> tuple[np.ndarray, int]:
        enc = rt.encode(pairs)                    # plan time: tokenize once
        out = run_units(lambda u: rt.logits([enc[i][0] for i in u], [enc[i][1] for i in u]),
                        [len(e[0]) for e in enc], list(range(len(enc))), [str(i) for i in range(len(enc))],
                        args.budget, MIN_FILL)
        assert not out.failures, out.failures
        return activate(np.stack([out.vectors[i] for i in range(len(enc))]), "sigmoid")[:, 0], out.padded

    def theirs() -> np.ndarray:
        return ce.predict(pairs, batch_size=args.batch_size)

    times: dict[str, list[float]] = {"batchinf": [], "cross_encoder_predict": []}
    answers: dict[str, object] = {}
    if not args.short:          # --short checks the answers, not the timing: its one rep gives them
        answers = {"batchinf": ours(), "cross_encoder_predict": theirs()}   # warm-up (untimed) and the answers
    for r in range(args.reps):
        for name in (("batchinf", "cross_encoder_predict") if r % 2 == 0 else
                     ("cross_encoder_predict", "batchinf")):
            t0 = time.perf_counter()
            answer = ours() if name == "batchinf" else theirs()
            times[name].append(time.perf_counter() - t0)
            answers.setdefault(name, answer)
    (scores, padded), reference = answers["batchinf"], answers["cross_encoder_predict"]
    enc = rt.encode(pairs)
    real = sum(len(e[0]) for e in enc)
    st_order = predict_order(ce, pairs)
    st_padded = sum(len(b) * max(len(enc[i][0]) for i in b)
                    for b in (st_order[s:s + args.batch_size] for s in range(0, len(enc), args.batch_size)))
    median = {k: float(np.median(v)) for k, v in times.items()}

    def side(name: str, pad: int) -> dict[str, object]:
        return {"seconds_median": round(median[name], 2), "seconds_min": round(min(times[name]), 2),
                "seconds": [round(t, 2) for t in times[name]],
                "pairs_per_s": round(len(pairs) / median[name], 1), "padding_efficiency": round(real / pad, 3)}

    print(json.dumps({
        "pairs": len(pairs), "threads": args.threads, "reps": args.reps, "real_tokens": real,
        "batchinf": side("batchinf", padded), "cross_encoder_predict": side("cross_encoder_predict", st_padded),
        "speedup": round(median["cross_encoder_predict"] / median["batchinf"], 2),
        "speedup_of_fastest": round(min(times["cross_encoder_predict"]) / min(times["batchinf"]), 2),
        "max_abs_diff": float(np.abs(scores - reference).max()),
    }, indent=1))


if __name__ == "__main__":
    main()
