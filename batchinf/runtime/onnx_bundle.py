"""Bundle import's ONNX export (`batchinf bundle import DIR --onnx`): an encoder bundle (embed,
score, classify) gains the graph the onnxruntime engine runs, pinned like every other file.

1. The model directory is staged (hard links, else copies) and the export is written into the
   staged copy (`ort/model.onnx`, int8 bundles `ort/model.int8.onnx`): runtime/onnx_export.py.
   bundle.json lists it in `files` with its sha256, so the bundle's digest covers it, and records
   how it was made (`onnx`: graph, exporter, optimizer, the fused operators, the quantizer).
2. The bundle's fixtures (computed by native) are replayed through ONNX Runtime: an embedding
   within cosine 0.9999 of its fixture (int8: the int8 gate's bound, runtime/int8.py, against the
   float32 fixtures), logits within 1e-4; else the import is refused, naming the fixture.
3. Native and ONNX Runtime are timed on the same batches (`BATCH_SHAPES`: a batch of short, of
   middling and of long sequences, each about one default token budget), one thread each (the
   default layout: one worker process per core), alternated, the best of `REPEATS`, in CPU time
   of the calling thread (both compute there with one thread), so that other processes sharing
   the machine do not decide the engine; and each engine's load in a fresh process (`load_cpu_s`:
   native's imports PyTorch, about 2 CPU-seconds more). Both are written in `onnx.measured`;
   where ONNX Runtime loads and computes a worker's share of a reference job (`reference_tokens`)
   sooner, the bundle declares it (`engine: {name: onnxruntime}`), so jobs run on it unless their
   manifest says `engine: native`.

The measurement makes the digest of an --onnx import depend on this machine's timings (the engine a
bundle declares is part of its identity); import once and move aliases, as for every bundle."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from batchinf.digests import sha256_file
from batchinf.errors import BundleError

GRAPH = "ort/model.onnx"
INT8_GRAPH = "ort/model.int8.onnx"
BATCH_SHAPES = ((128, 16), (32, 64), (8, 256))     # (sequences, tokens each): about 2048 tokens a batch
REPEATS = 3
PACKAGES = ("onnxruntime", "onnx")


def _require_packages() -> None:
    import importlib.util

    lacking = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if lacking:
        raise BundleError(f"--onnx needs {', '.join(lacking)}, which this environment lacks: "
                          "pip install 'batchinf[onnx]'")


def _stage(src: Path, files: dict[str, str], dst: Path) -> Path:
    """The bundle's files under `dst`: hard links where the file system allows, else copies."""
    for name in files:
        target = dst / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src / name, target)
        except OSError:
            shutil.copy2(src / name, target)
    return dst


def add_onnx(src: Path, meta: dict[str, Any], tmp: Path) -> tuple[Path, dict[str, Any]]:
    """(the directory to import, bundle.json) with the ONNX export added, checked and measured."""
    from batchinf.runtime.int8 import scheme_of
    from batchinf.runtime.onnx_export import export, problem
    from batchinf.runtime.onnx_int8 import quantize

    if (why := problem(meta)) is not None:
        raise BundleError(f"{src}: --onnx: {why}")
    _require_packages()
    staged = _stage(src, meta["files"], tmp / "onnx-bundle")
    fp32 = staged / GRAPH
    info = export(staged, meta, fp32)
    graph = GRAPH
    if meta.get("precision") == "int8":
        info.update(quantize(fp32, staged / INT8_GRAPH, scheme_of(meta)))
        fp32.unlink()
        graph = INT8_GRAPH
    out = {**meta, "files": {**meta["files"], graph: sha256_file(staged / graph)}, "onnx": {"graph": graph, **info}}
    ort = _open(staged, out, "onnxruntime")
    ort.load_model()
    try:
        ort.verify_fixtures()
    except BundleError as exc:
        raise BundleError(f"{src}: refusing the --onnx import: {exc}") from None
    measured = measure(_open(staged, out, "native"), ort, out)
    measured["load_cpu_s"] = {e: load_cpu_seconds(staged, out, e) for e in ("native", "onnxruntime")}
    measured["reference_tokens"] = reference_tokens()
    out["onnx"]["measured"] = measured
    if faster(measured) == "onnxruntime":
        out["engine"] = {"name": "onnxruntime"}
    return staged, out


REFERENCE_SHARDS = 4      # planning/sizing.SHARDS_PER_WORKER (a test keeps them equal; planning sits above runtime)


def reference_tokens() -> int:
    """The work a worker of the job the choice is made for computes: its share of the smallest job
    that gives every worker its SHARDS_PER_WORKER shards of BATCHINF_MIN_SHARD_TOKENS. Smaller jobs
    weigh the load more, larger ones the speed; the manifest's `engine:` decides for a job that differs."""
    from batchinf.config import settings

    return REFERENCE_SHARDS * settings().min_shard_tokens


def faster(measured: dict[str, Any]) -> str:
    """The engine whose worker loads the bundle and computes `reference_tokens` sooner (CPU
    seconds): the load counts because a worker pays it once a job (native's imports PyTorch)."""
    speed, load, tokens = measured["tokens_per_s"], measured["load_cpu_s"], measured["reference_tokens"]
    return min(("native", "onnxruntime"), key=lambda e: load[e] + tokens / speed[e])


LOAD_PROGRAM = """
import json, sys
from pathlib import Path
from batchinf.engines import open_runtime
from batchinf.tasks import get_task
meta = json.loads(sys.argv[3])
open_runtime(sys.argv[2], get_task(meta["task"]), Path(sys.argv[1]), meta, "cpu").load_model()
"""


def load_cpu_seconds(root: Path, meta: dict[str, Any], engine: str) -> float:
    """CPU seconds a fresh worker process spends from its start to `engine`'s runtime of the bundle
    loaded (interpreter, imports, weights), the best of two: CPU time, so that other processes
    sharing the machine do not decide the engine."""
    import json
    import resource
    import subprocess
    import sys

    best = float("inf")
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", LOAD_PROGRAM, str(root), engine, json.dumps(meta)], check=True,
                       capture_output=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        best = min(best, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return round(best, 3)


def _open(root: Path, meta: dict[str, Any], engine: str) -> Any:
    from batchinf.engines import open_runtime
    from batchinf.tasks import get_task

    return open_runtime(engine, get_task(meta["task"]), root, meta, "cpu")


def _forward(runtime: Any) -> Callable[[list[list[int]]], Any]:
    if hasattr(runtime, "embed"):
        return runtime.embed
    return lambda batch: runtime.logits(batch, [[0] * len(x) for x in batch])


def _batches(meta: dict[str, Any]) -> list[list[list[int]]]:
    """BATCH_SHAPES of real token ids (the longest fixture's, repeated), lengths capped at the bundle's."""
    longest = max((fx.get("input_ids") or fx["token_ids"] for fx in meta["fixtures"]), key=len)
    ids = (longest * (1 + 256 // max(1, len(longest))))[:int(meta["max_length"])]
    return [[ids[:min(s, len(ids))]] * b for b, s in BATCH_SHAPES]


def measure(native: Any, ort: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s of `native` and `ort` on the same batches, one thread each, alternated, the best of REPEATS."""
    import torch

    from batchinf.runtime.onnx_encoder import graph_path, session

    batches = _batches(meta)
    tokens = sum(len(b) * len(b[0]) for b in batches)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    ort.model = session(graph_path(ort.root, ort.meta), 1)
    native.load_model()
    runs = {"native": _forward(native), "onnxruntime": _forward(ort)}
    best = {k: float("inf") for k in runs}
    try:
        for _ in range(REPEATS + 1):            # the first pass warms both up
            for name, forward in runs.items():
                t0 = time.thread_time()
                for batch in batches:
                    forward(batch)
                best[name] = min(best[name], time.thread_time() - t0)
    finally:
        torch.set_num_threads(before)
    return {"threads": 1, "batches": [list(s) for s in BATCH_SHAPES],
            "tokens_per_s": {k: int(np.round(tokens / v)) for k, v in best.items()}}
