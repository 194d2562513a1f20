"""The int8 CPU precision of BERT-family encoders, and its quality gate.

Weights: int8 with one scale per output channel (symmetric). Activations: quantised per token
(per row, asymmetric, u8) just before each GEMM, so a record's vector never depends on the
records batched beside it. The GEMM is oneDNN's (`torch.ops.onednn.qlinear_*`, PyTorch's own x86
int8 kernels, fed plain u8/s8 tensors); the row scales, zero points and bias are applied to its
float32 output in one pass.

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
import torch
from torch import Tensor, nn

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
    caps = torch._C._cpu._get_cpu_capability()
    return bool(caps.get("avx512_vnni") or caps.get("avx_vnni"))


def best_scheme() -> str:
    """The fastest scheme this CPU computes exactly."""
    return "vnni" if has_vnni() else "avx2"


def scheme_of(meta: dict[str, Any]) -> str:
    return str(meta.get("int8_scheme", "avx2"))


class Int8Linear(nn.Module):
    """y = x W^T + b (+ residual) with int8 per-channel weights and per-token u8 activations.

    Each row x_i is quantised over [min(x_i, 0), max(x_i, 0)] in 254 steps: q_i = x_i / step_i +
    zp_i. The GEMM itself subtracts the zero points: q carries T more columns that each hold zp_i,
    and W8 T more columns, each within ±wmax, that sum to -sum_k W8[j, k]; so acc = (q_i - zp_i) . W8_j
    and y_i = step_i * acc_i + b is one pass over the output."""

    def __init__(self, weight: Tensor, bias: Tensor | None, wmax: int) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(1).clamp_min(1e-12) / wmax
        w8 = torch.round(w / scale[:, None]).clamp_(-wmax, wmax).to(torch.int64)      # [N, K]
        neg = -w8.sum(1, keepdim=True)                                                  # [N, 1]
        t = max(1, -(-int(neg.abs().max()) // wmax))
        t += -(w.shape[1] + t) % 4                   # K + T a multiple of VNNI's groups of 4
        base, rest = torch.div(neg, t, rounding_mode="floor"), neg.remainder(t)
        cols = base + (torch.arange(t) < rest).long()                                   # [N, T], sums to neg
        self.in_features, self.out_features, self.zp_columns = w.shape[1], w.shape[0], t
        self.packed = torch.ops.onednn.qlinear_prepack(torch.cat([w8, cols], 1).to(torch.int8), None)
        self.scale = scale
        self.zeros = torch.zeros(w.shape[0], dtype=torch.int64)
        self.bias = bias.detach().float() if bias is not None else torch.zeros(w.shape[0])

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        shape, k = x.shape, self.in_features
        x = x.reshape(-1, k)                                                             # [M, K]
        lo, hi = x.amin(-1, keepdim=True).clamp_max_(0), x.amax(-1, keepdim=True).clamp_min_(0)
        step = (hi - lo).clamp_min_(1e-12).div_(_STEPS)                                  # [M, 1]
        zp = lo.div_(step).neg_().round_()                                               # 0..254
        q = torch.empty(x.shape[0], k + self.zp_columns, dtype=torch.uint8)            # [M, K + T]
        # x / step + zp lies in [-0.5, 254.5]; + 0.5 and truncation rounds it into 0..255
        q[:, :k] = torch.addcmul(zp + 0.5, x, step.reciprocal())
        q[:, k:] = zp
        acc = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, self.packed, self.scale, self.zeros, None, 1.0, 0,
                                                 torch.float32, "none", [], "")         # [M, N]
        y = torch.addcmul(self.bias, acc, step, out=acc)
        if residual is not None:
            y.add_(residual.reshape(y.shape))
        return y.view(*shape[:-1], self.out_features)


def quantize_encoder(model: nn.Module, scheme: str = "avx2") -> nn.Module:
    """Switch a BertEncoder's linear layers to int8 in place under `scheme` (see the module
    docstring for which); their float32 weights, and prepacked copies of them, are dropped."""
    s = SCHEMES[scheme]
    for layer in model.encoder.layer:
        for m in (layer.attention.self, layer.attention.output, layer.intermediate):
            m.packed = None
        sa = layer.attention.self
        sa.int8 = Int8Linear(*sa.qkv_weights(), s.wmax)
        sa.query = sa.key = sa.value = None
        sa._fused = None
        residuals = [layer.attention.output] + ([layer.output] if s.ffn_output else [])
        for out in residuals:
            out.packed = None
            out.int8 = Int8Linear(out.dense.weight, out.dense.bias, s.wmax)
            out.dense = None
        layer.intermediate.dense = Int8Linear(layer.intermediate.dense.weight, layer.intermediate.dense.bias, s.wmax)
    return model


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
