"""batchinf against the peers CPU users run (issue #32): the plain ONNX Runtime script
(benchmarks/ort_embed_script.py, float32 and int8) and Ray Data (benchmarks/ray_embed_script.py:
`map_batches` with a sentence-transformers actor per core), all-MiniLM-L6-v2, max length 256.

Each contender is a whole process, JSONL in and Parquet out, timed from its start to its exit:
  batchinf            `batchinf run MANIFEST` in its default layout (one worker process per core),
                      the bundle imported with --onnx: the engine its import measured faster;
  batchinf, onnxruntime  the same with `engine: onnxruntime` in the manifest (left out where the
                      bundle already declares onnxruntime: it would be the same job);
  batchinf int8       the bundle imported --precision int8 --onnx (its int8 graph: runtime/onnx_int8.py;
                      where the import is refused, --precision int8 alone: batchinf's own int8 runtime);
  ORT fp32 / ORT int8 the plain script: 2 intra-op threads, records sorted by token length,
                      batches of 64 (its graph exported once beforehand, untimed, as batchinf's
                      bundle is imported once);
  Ray Data            one actor per core, batches of 64 (skipped, and said so, when `import ray`
                      fails in --ray-python, or with --no-ray).
Three corpora made deterministically (short sentences of 10-30 words; docstrings of this Python's
standard library; mixed lengths: log-normal word counts, a heavy tail past 256 tokens), `--records`
each. Within each repetition the contenders alternate (per corpus: batchinf, each peer, ...), so
load that drifts weighs on all; the table gives medians of `--reps`, records/s, and batchinf's
ratio to each peer (peer's median seconds / batchinf's). Vectors are checked against
sentence-transformers': minimum cosine per contender (float32: at least 0.9999).

    python benchmarks/embed_peers.py                          # 5,000 records a corpus, 3 repetitions
    python benchmarks/embed_peers.py --records 2000 --reps 3 --json
    python benchmarks/embed_peers.py --short --json           # CI: tiny corpora, correctness only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from embed_throughput import WORDS, make_corpus, make_docstring_corpus, minilm_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
RAY_VENV = Path.home() / ".cache" / "batchinf-bench" / "ray-venv"
FP32_MIN_COSINE = 0.9999


def make_short(path: Path, n: int, seed: int = 0) -> None:
    """Short sentences: 10-30 words each."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 30)))
            f.write(json.dumps({"id": f"s{i}", "text": words.capitalize() + "."}) + "\n")


CORPORA = {"short sentences": make_short, "docstrings": make_docstring_corpus, "mixed lengths": make_corpus}


def timed(cmd: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... exited {r.returncode}:\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
    return wall


def cli(env: dict[str, str], *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "batchinf.cli", *args], env=env, check=True, capture_output=True,
                          text=True).stdout


def ray_python(wanted: str | None) -> str | None:
    """The interpreter Ray Data runs in: --ray-python, else the benchmark venv (RAY_VENV), else this one;
    None when none of them imports ray."""
    for exe in [wanted] if wanted else [str(RAY_VENV / "bin" / "python"), sys.executable]:
        if exe and Path(exe).exists() and subprocess.run([exe, "-c", "import ray, ray.data, sentence_transformers"],
                                                         capture_output=True).returncode == 0:
            return exe
    return None


class Contenders:
    """What each contender runs, set up once (bundles imported, graphs exported), untimed."""

    def __init__(self, root: Path, cores: int, ray_exe: str | None, int8: bool) -> None:
        self.root, self.cores, self.ray_exe, self.model, self.with_int8 = root, cores, ray_exe, minilm_dir(), int8
        self.env = {**os.environ, "BATCHINF_HOME": str(root / "home")}
        self.env.pop("BATCHINF_DATABASE_URL", None)
        cli(self.env, "bundle", "import", str(self.model), "--name", "minilm", "--alias", "fp32", "--onnx")
        self.meta = {"fp32": self._meta("minilm@fp32")}
        self.int8 = None
        if int8:       # with the int8 ONNX graph where its import passes the int8 gate, else batchinf's own int8 alone
            for extra in (["--onnx"], []):
                r = subprocess.run([sys.executable, "-m", "batchinf.cli", "bundle", "import", str(self.model), "--name",
                                    "minilm", "--alias", "int8", "--precision", "int8", *extra], env=self.env,
                                   capture_output=True, text=True)
                if r.returncode == 0:
                    self.meta["int8"] = self._meta("minilm@int8")
                    break
                self.int8 = f"--precision int8 --onnx refused: {' '.join(r.stderr.split())[-400:]}"
            self.int8 = ("enabled" + (f" without the ORT graph ({self.int8})" if self.int8 else "")
                         if "int8" in self.meta else (self.int8 or "") + "; --precision int8 refused too")
        script = str(HERE / "ort_embed_script.py")
        for name, extra in (("fp32", []), ("int8", ["--int8"]))[:2 if int8 else 1]:
            subprocess.run([sys.executable, script, "export", str(self.model), str(root / f"ort-{name}.onnx"), *extra],
                           check=True, capture_output=True)
        self.runs = 0

    def _meta(self, ref: str) -> dict[str, Any]:
        digest = json.loads(cli(self.env, "bundle", "list", "--json"))
        info = next(b for b in digest if ref in b["aliases"])
        return json.loads((self.root / "home" / "bundles" / info["digest"].removeprefix("sha256:") /
                           "bundle.json").read_text())

    def names(self) -> list[str]:
        declared = (self.meta["fp32"].get("engine") or {}).get("name")
        out = ["batchinf", *(["batchinf, onnxruntime"] if declared != "onnxruntime" else []),
               *(["batchinf int8"] if "int8" in self.meta else []),
               "ORT fp32 script", *(["ORT int8 script"] if self.with_int8 else [])]
        return out + (["Ray Data"] if self.ray_exe else [])

    def run(self, name: str, corpus: Path) -> tuple[float, Path]:
        """(wall seconds of the whole process, where its Parquet output is)."""
        self.runs += 1
        out = self.root / "out" / f"{self.runs}"
        if name.startswith("batchinf"):
            manifest = self.root / f"job-{self.runs}.json"
            manifest.write_text(json.dumps({
                "name": f"peers-{self.runs}", "task": "embed", "input": {"uri": str(corpus), "format": "jsonl"},
                "bundle": "minilm@int8" if name == "batchinf int8" else "minilm@fp32", "output": {"uri": str(out)},
                "options": {"max_length": 256}, **({"engine": "onnxruntime"} if "onnxruntime" in name else {})}))
            return timed([sys.executable, "-m", "batchinf.cli", "run", str(manifest), "--json"], self.env), out
        if name.startswith("ORT"):
            graph = self.root / f"ort-{'int8' if 'int8' in name else 'fp32'}.onnx"
            out.parent.mkdir(parents=True, exist_ok=True)
            dst = out.with_suffix(".parquet")
            return timed([sys.executable, str(HERE / "ort_embed_script.py"), "run", str(graph), str(self.model),
                          str(corpus), str(dst)]), dst
        assert self.ray_exe is not None
        return timed([self.ray_exe, str(HERE / "ray_embed_script.py"), str(self.model), str(corpus), str(out),
                      str(self.cores)]), out


def read_vectors(path: Path) -> dict[str, Any]:
    import numpy as np
    import pyarrow.parquet as pq

    t = pq.read_table(path, ignore_prefixes=["_", "errors", "."])
    ids = t.column("record_id" if "record_id" in t.column_names else "id").to_pylist()
    return dict(zip(ids, np.asarray(t.column("embedding").to_pylist(), dtype=np.float32)))


def reference(corpus: Path) -> dict[str, Any]:
    """sentence-transformers' vectors of the corpus (max length 256), by record id."""
    from sentence_transformers import SentenceTransformer

    rows = [json.loads(line) for line in open(corpus)]
    model = SentenceTransformer(str(minilm_dir()), device="cpu")
    model.max_seq_length = 256
    vectors = model.encode([r["text"] for r in rows], batch_size=64, convert_to_numpy=True)
    return {r["id"]: v for r, v in zip(rows, vectors)}


def min_cosine(got: dict[str, Any], want: dict[str, Any]) -> float:
    import numpy as np

    assert set(got) == set(want), f"{len(set(want) - set(got))} records missing, {len(set(got) - set(want))} extra"
    keys = sorted(want)
    a, b = np.stack([got[k] for k in keys]), np.stack([want[k] for k in keys])
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)).min())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=None, help="records a corpus (default 5000; --short: 40)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 3; --short: 1)")
    ap.add_argument("--corpus", action="append", choices=list(CORPORA), help="only these corpora (repeatable)")
    ap.add_argument("--ray-python", default=None, help="an interpreter with ray[data] and sentence-transformers "
                                                       f"(default: {RAY_VENV}/bin/python, else this one)")
    ap.add_argument("--no-int8", action="store_true", help="leave the int8 contenders out")
    ap.add_argument("--no-ray", action="store_true", help="leave Ray Data out")
    ap.add_argument("--short", action="store_true", help="tiny corpora, one repetition: correctness only")
    ap.add_argument("--json", action="store_true", help="print only the JSON report")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    records, reps = args.records or (40 if args.short else 5000), args.reps or (1 if args.short else 3)
    cores = os.cpu_count() or 1
    root = Path(tempfile.mkdtemp(prefix="batchinf-peers-"))
    ray_exe = None if args.no_ray else ray_python(args.ray_python)
    def log(*a: Any) -> None:
        print(*a, file=sys.stderr, flush=True)
    log(f"work dir {root}; Ray Data: {ray_exe or 'not available'}")
    contenders = Contenders(root, cores, ray_exe, not args.no_int8)
    names = contenders.names()
    corpora = {}
    for kind in args.corpus or CORPORA:
        path = root / f"{kind.replace(' ', '-')}.jsonl"
        CORPORA[kind](path, records)
        corpora[kind] = path
    walls: dict[str, dict[str, list[float]]] = {k: {n: [] for n in names} for k in corpora}
    outputs: dict[str, dict[str, Path]] = {k: {} for k in corpora}
    for rep in range(reps):
        for kind, path in corpora.items():
            for name in names:
                wall, out = contenders.run(name, path)
                walls[kind][name].append(wall)
                outputs[kind][name] = out
                log(f"rep {rep} {kind:16s} {name:24s} {wall:7.2f} s")
    report: dict[str, Any] = {
        "records": records, "reps": reps, "cores": cores, "model": "all-MiniLM-L6-v2", "max_length": 256,
        "engine_chosen_at_import": (contenders.meta["fp32"].get("engine") or {}).get("name", "native"),
        "import_measured_tokens_per_s": contenders.meta["fp32"]["onnx"]["measured"]["tokens_per_s"],
        "int8": contenders.int8 or "not run",
        "ray_data": ray_exe or ("left out (--no-ray)" if args.no_ray else "not available: `import ray` failed"),
        "load_average": os.getloadavg(), "corpora": {}}
    for kind, path in corpora.items():
        want = reference(path)
        n = sum(1 for _ in open(path))
        med = {name: statistics.median(v) for name, v in walls[kind].items()}
        cos = {name: round(min_cosine(read_vectors(outputs[kind][name]), want), 6) for name in names}
        base = med["batchinf"]
        report["corpora"][kind] = {
            "records": n, "seconds": {k: [round(x, 3) for x in v] for k, v in walls[kind].items()},
            "median_s": {k: round(v, 3) for k, v in med.items()},
            "records_per_s": {k: round(n / v, 1) for k, v in med.items()},
            "batchinf_ratio": {k: round(v / base, 2) for k, v in med.items() if not k.startswith("batchinf")},
            **({"batchinf_int8_ratio_vs_ort_int8": round(med["ORT int8 script"] / med["batchinf int8"], 2)}
               if "batchinf int8" in med else {}),
            "min_cosine_vs_sentence_transformers": cos}
        bad = [k for k, c in cos.items() if "int8" not in k and c < FP32_MIN_COSINE]
        if bad:
            raise SystemExit(f"{kind}: float32 vectors of {', '.join(bad)} below cosine {FP32_MIN_COSINE}: {cos}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print_table(report)


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for kind, r in report["corpora"].items():
        t = Table(title=f"{kind}: {r['records']} records, medians of {report['reps']} (whole process)")
        for c in ("contender", "median s", "records/s", "batchinf ratio", "min cosine vs ST"):
            t.add_column(c, justify="left" if c == "contender" else "right")
        for name, s in r["median_s"].items():
            ratio = r["batchinf_ratio"].get(name)
            t.add_row(name, f"{s:.2f}", f"{r['records_per_s'][name]:.0f}", f"{ratio:.2f}x" if ratio else "",
                      f"{r['min_cosine_vs_sentence_transformers'][name]:.6f}")
        console.print(t)
        if "batchinf_int8_ratio_vs_ort_int8" in r:
            console.print(f"  batchinf int8 / ORT int8 script: {r['batchinf_int8_ratio_vs_ort_int8']:.2f}x")
    console.print(f"engine chosen at import: {report['engine_chosen_at_import']} "
                  f"({report['import_measured_tokens_per_s']}); int8: {report['int8']}; Ray Data: {report['ray_data']}")


if __name__ == "__main__":
    main()
