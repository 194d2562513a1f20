"""The int8 CPU precision of BERT-family encoders, and its quality gate.

Weights: int8 with one scale per output channel (symmetric). Activations: quantised per token
(per row, asymmetric, u8) just before each GEMM, so a record's vector never depends on the
records batched beside it. Native's GEMM is oneDNN's (runtime/int8_linear.py); the
onnxruntime engine's, MLAS's (runtime/onnx_int8.py). This module is the precision's definition
(schemes, the gate, what a worker can run) and imports no PyTorch.

Two schemes, chosen at import and recorded in bundle.json (`int8_scheme`), because what is exact
depends on the CPU's int8 instruction:
- `vnni` (CPUs with AVX-512 VNNI or AVX-VNNI): weights within ±127, all four projections of a
  layer in int8. VNNI's vpdpbusd accumulates u8 x s8 products straight into 32 bits.
- `avx2` (any x86-64 with AVX2): weights within ±63, the FFN output projection in float32.
  AVX2's vpmaddubsw sums pairs of u8 x s8 products into 16 bits with saturation; 255 x 63 x 2 <
  32767 cannot saturate, ±127 does (minimum cosine 0.93 on all-MiniLM-L6-v2), and the GELU
  output that feeds the FFN output projection is the activation that quantises worst at 7 bits.
A `vnni` bundle is refused by a worker whose CPU has no VNNI (its GEMMs would saturate there);
an `avx2` bundle runs anywhere. Bundles from before schemes existed are `avx2`.

A bundle imported with `--precision int8` records `precision: int8`; its fixtures stay the
float32 reference, and the int8 model must reach `min_cosine` against them, at import and at
every load, or it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from batchinf.errors import BundleError

PRECISIONS = ("float32", "int8")
MIN_COSINE = 0.995      # declared bound: int8 fixtures vs the float32 reference
_STEPS = 254            # u8 activation steps; x / step + zp + 0.5 then stays below 256
INT8_FAMILIES = ("bert", "roberta", "xlm-roberta")


@dataclass(frozen=True)
class Scheme:
    wmax: int           # weights within ±wmax
    ffn_output: bool    # whether the FFN output projection runs int8 too
    needs_vnni: bool


SCHEMES = {"vnni": Scheme(wmax=127, ffn_output=True, needs_vnni=True),
           "avx2": Scheme(wmax=63, ffn_output=False, needs_vnni=False)}


def has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI or AVX-VNNI: from the kernel's CPU flags (a worker on the
    onnxruntime engine never imports PyTorch), else from PyTorch's CPU capability."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        flags = None
    if flags is not None:
        return "avx512_vnni" in flags or "avx_vnni" in flags
    import torch

    caps = torch._C._cpu._get_cpu_capability()
    return bool(caps.get("avx512_vnni") or caps.get("avx_vnni"))


def best_scheme() -> str:
    """The fastest scheme this CPU computes exactly."""
    return "vnni" if has_vnni() else "avx2"


def int8_weights(w: np.ndarray, wmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Float weights `w` [K, N] -> (int8 weights [K + T, N], float32 scale per output channel [N]).
    Each channel's weights within ±wmax of its scale, then T zero-point rows, each within ±wmax,
    summing to minus the channel's int8 weights (K + T a multiple of VNNI's groups of 4): a GEMM
    of activations quantised per row (q_i, zero point zp_i) given T more columns that each hold
    zp_i accumulates (q_i - zp_i) . w8 exactly, with no per-row zero point in the kernel."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.maximum(np.abs(w).max(0) / np.float32(wmax), np.float32(1e-12)).astype(np.float32)
    w8 = np.clip(np.round(w / scale), -wmax, wmax).astype(np.int64)
    neg = -w8.sum(0)
    t = max(1, -(-int(np.abs(neg).max()) // wmax))
    t += -(w.shape[0] + t) % 4
    base, rest = np.floor_divide(neg, t), np.remainder(neg, t)
    cols = base[None, :] + (np.arange(t)[:, None] < rest[None, :])
    return np.concatenate([w8, cols]).astype(np.int8), scale


def scheme_of(meta: dict[str, Any]) -> str:
    return str(meta.get("int8_scheme", "avx2"))


def check_supported(meta: dict[str, Any], device: str) -> None:
    """An int8 bundle is a native BERT-family embedding bundle and runs on CPU only, in a scheme
    this CPU computes exactly."""
    embeds = bool(meta.get("fixtures")) and all("embedding" in fx for fx in meta["fixtures"])
    if not embeds or meta.get("encoder") or meta.get("family") not in INT8_FAMILIES:
        raise BundleError(f"precision int8 covers native {', '.join(INT8_FAMILIES)} embedding models; this one is "
                          f"task {meta.get('task')!r}, family {meta.get('family')!r}: import it in float32")
    if device != "cpu":
        raise BundleError(f"this bundle is int8, a CPU precision; run it with device cpu (not {device!r}), or "
                          "import the model again in float32 for CUDA")
    scheme = scheme_of(meta)
    if scheme not in SCHEMES:
        raise BundleError(f"int8 scheme {scheme!r} is not one of {', '.join(SCHEMES)}; import the model again")
    if SCHEMES[scheme].needs_vnni and not has_vnni():
        raise BundleError("this int8 bundle uses the 'vnni' scheme (8-bit weights), which needs a CPU with AVX-512 "
                          "VNNI or AVX-VNNI, and this worker's CPU has neither (its int8 sums would saturate); "
                          "run it on such workers, or import the model with --int8-scheme avx2 for any x86 CPU")


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1) + 1e-12)


def int8_meta(meta: dict[str, Any], scheme: str | None = None) -> dict[str, Any]:
    """bundle.json of the int8 variant of a float32 embed bundle `meta` (before its gate), in
    `scheme` (default: this CPU's best)."""
    scheme = scheme or best_scheme()
    out = {**meta, "precision": "int8", "int8_scheme": scheme, "precision_gate": {"min_cosine": MIN_COSINE}}
    check_supported(out, "cpu")
    return out


def gate(runtime: Any) -> dict[str, Any]:
    """The import gate: an EmbedRuntime over `int8_meta(...)` must embed every fixture (the float32
    reference) within `MIN_COSINE`, or the import is refused; returns its meta with the measure."""
    meta = runtime.meta
    got, _ = runtime.embed([fx["token_ids"] for fx in meta["fixtures"]])
    cos = cosines(got, np.asarray([fx["embedding"] for fx in meta["fixtures"]], dtype=np.float32))
    worst = int(cos.argmin())
    if cos[worst] < MIN_COSINE:
        raise BundleError(f"{runtime.root}: refusing the int8 import: fixture {worst} "
                          f"({meta['fixtures'][worst]['text'][:40]!r}) reaches minimum cosine {cos[worst]:.6f} "
                          f"against float32, below the bound {MIN_COSINE}; this model does not quantise well: "
                          "import it in float32")
    return {**meta, "precision_gate": {**meta["precision_gate"], "measured": round(float(cos[worst]), 4)}}
