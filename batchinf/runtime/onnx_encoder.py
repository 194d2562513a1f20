"""Encoder bundles executed by ONNX Runtime on CPU (the onnxruntime engine): embed, score, classify.

The runtimes give the tasks what native's give (token-id batches in; vectors, or raw logits, and
the padded positions computed out), over the bundle's pinned ONNX graph (runtime/onnx_export.py,
`onnx.graph` in bundle.json). An embed graph ends with the bundle's pooling, Dense layers and
normalisation, so an embed worker on this engine never imports PyTorch.

One session per worker process: intra-op threads = the worker's threads (one per process in the
default layout: the processes, not a thread pool, share the cores), one inter-op thread,
sequential execution, and no spinning (a spinning pool thread takes a core another worker
process computes on). Batches vary in shape freely (dynamic batch and sequence axes).

The bundle's fixtures are replayed through the session at load: each embedding within cosine
0.9999 of the recorded one (an int8 graph: its import gate's bound), each fixture's logits within
1e-4 (relative); a difference is refused naming the fixture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from batchinf.errors import BatchinfError, BundleError
from batchinf.runtime.embed import EmbedRuntime
from batchinf.runtime.fixture_checks import check_embeddings
from batchinf.runtime.threads import worker_threads

EMBED_MIN_COSINE = 0.9999          # as native's float32 fixtures (runtime/bundle.verify_model_fixtures)
WHY = "the graph does not compute what the bundle pinned"
FIX = "re-import the bundle with --onnx, or run it on engine native"


def session(path: Path, threads: int) -> Any:
    """An ONNX Runtime CPU session over the graph at `path` with `threads` intra-op threads."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 -- ORT raises its own Fail/InvalidGraph/... for a bad graph
        raise BundleError(f"ONNX Runtime cannot load {path}: {type(exc).__name__}: {str(exc)[:300]}; "
                          "re-import the bundle with --onnx, or run it on engine native") from exc


def graph_path(root: Path, meta: dict[str, Any]) -> Path:
    from batchinf.runtime.bundle import file_path

    spec = meta.get("onnx")
    if not isinstance(spec, dict) or spec.get("graph") not in meta.get("files", {}):
        raise BundleError(f"{root}/bundle.json names no ONNX graph among its files; import the model again with "
                          "`batchinf bundle import DIR --onnx`, or run it on engine native")
    return file_path(root, spec["graph"])


def padded(batch: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token-id lists -> right-padded input ids and attention mask, int64 [B, S]."""
    if not batch or min(map(len, batch)) == 0:
        raise BatchinfError("an encoder batch needs non-empty token sequences")
    ids = np.full((len(batch), max(map(len, batch))), pad_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, seq in enumerate(batch):
        ids[i, :len(seq)] = seq
        mask[i, :len(seq)] = 1
    return ids, mask


class OrtEmbedRuntime(EmbedRuntime):
    """An embed bundle executed by ONNX Runtime: the tokenizer and fixtures are the bundle's, the
    whole model (encoder, pooling, Dense, normalisation) its ONNX graph."""

    engine = "onnxruntime"
    uses_torch = False

    def load_model(self) -> None:
        if self.model is None:
            if self.meta.get("precision") == "int8":
                from batchinf.runtime import int8

                int8.check_supported(self.meta, "cpu")
            self.model = session(graph_path(self.root, self.meta), worker_threads())

    def embed(self, batch: list[list[int]]) -> tuple[np.ndarray, int]:
        """batch of token-id lists -> (float32 [B, D'], padded token positions computed)."""
        if self.model is None:
            self.load_model()
        ids, mask = padded(batch, self.tokenizer.pad_id)
        out = self.model.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        return np.asarray(out, dtype=np.float32), ids.size

    def verify_fixtures(self) -> None:
        """Each fixture's embedding within EMBED_MIN_COSINE (int8: the import gate's bound) of the recorded one."""
        fixtures = self.meta["fixtures"]
        got, _ = self.embed([fx["token_ids"] for fx in fixtures])
        floor = float(self.meta["precision_gate"]["min_cosine"]) if self.meta.get("precision") == "int8" \
            else EMBED_MIN_COSINE
        check_embeddings(got, fixtures, floor, self.root, engine="onnxruntime", whose="the ONNX graph's", why=WHY,
                         fix=FIX)
