"""An engine's answers to a bundle's model fixtures against the recorded ones (vllm, onnxruntime):
embeddings by cosine, logits by their largest difference relative to the largest recorded logit.
A disagreement is a BundleError naming the fixture, what the engine gave, and the fix. numpy only:
an engine that runs without PyTorch checks with it too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from batchinf.errors import BundleError


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1) + 1e-12)


def check_embeddings(got: np.ndarray, fixtures: list[dict[str, Any]], floor: float, root: Path, *, engine: str,
                     whose: str, why: str, fix: str) -> None:
    """Each fixture's embedding in `got` within cosine `floor` of the recorded one (NaN is drift too)."""
    cos = cosines(got, np.asarray([fx["embedding"] for fx in fixtures], dtype=np.float32))
    bad = np.flatnonzero(~(cos >= floor))
    if bad.size:
        i = int(bad[0])
        raise BundleError(f"{engine} fixture {i} of bundle {root} ({fixtures[i].get('text', '')[:60]!r}): {whose} "
                          f"embedding has cosine {cos[i]:.6f} < {floor} to the recorded one: {why}; {fix}")


def check_logits(got: np.ndarray, fixtures: list[dict[str, Any]], tolerance: float, root: Path, *, engine: str,
                 whose: str, why: str, fix: str) -> None:
    """Each fixture's logits in `got` within `tolerance` (relative to its largest) of the recorded ones."""
    want = np.asarray([f["logits"] for f in fixtures], dtype=np.float32)
    err = np.abs(got - want).max(axis=1) / np.maximum(1.0, np.abs(want).max(axis=1))
    bad = np.flatnonzero(~(err <= tolerance))
    if bad.size:
        i = int(bad[0])
        raise BundleError(f"{engine} fixture {i} of bundle {root}: {whose} logits {got[i].tolist()} are {err[i]:.2e} "
                          f"away from the recorded {want[i].tolist()}: {why}; {fix}")
