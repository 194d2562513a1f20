"""The int8 CPU precision of BERT-family encoders, and its quality gate.

Weights: int8 with one scale per output channel (symmetric, within ±63). Activations: quantised
per token (per row, asymmetric, u8 0..255) just before each GEMM, so a record's vector never
depends on the records batched beside it. 255 x 63 x 2 < 32767: the u8 x s8 products cannot
saturate the 16-bit pair sums of AVX2's int8 instruction (vpmaddubsw, no VNNI); with full-range
±127 weights they do, and on all-MiniLM-L6-v2 the minimum cosine fell to 0.93. The GEMM is oneDNN's (`torch.ops.onednn.qlinear_*`,
PyTorch's own x86 int8 kernels, fed plain int8 tensors); the row scales and zero points are
applied to its float32 output. The query/key/value projection, the attention output and the
FFN input projection run int8; the FFN output projection stays float32 (its input, the GELU
output, is the activation that quantises worst: see README "Performance").

A bundle imported with `--precision int8` records `precision: int8`; its fixtures stay the
float32 reference, and the int8 model must reach `min_cosine` against them, at import and at
every load, or it is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from batchinf.errors import BundleError

PRECISIONS = ("float32", "int8")
MIN_COSINE = 0.995      # declared bound: int8 fixtures vs the float32 reference
_LEVELS = 255           # u8 activations
_WMAX = 63              # weights within ±63: no saturation in AVX2's vpmaddubsw pair sums
INT8_FAMILIES = ("bert", "roberta", "xlm-roberta")


class Int8Linear(nn.Module):
    """y = x W^T + b with int8 per-channel weights and per-token int8 activations."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(1).clamp_min(1e-12) / _WMAX
        w8 = torch.round(w / scale[:, None]).clamp_(-_WMAX, _WMAX).to(torch.int8)
        self.out_features = w.shape[0]
        self.packed = torch.ops.onednn.qlinear_prepack(w8, None)
        self.scale = scale
        self.zeros = torch.zeros(w.shape[0], dtype=torch.int64)
        # a row's zero point times each output channel's weight sum: the correction for
        # quantising activations around zp instead of 0
        self.wsum = w8.float().sum(1) * scale
        self.bias = (bias.detach().float() if bias is not None else torch.zeros(w.shape[0]))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        lo, hi = torch.aminmax(x, dim=-1, keepdim=True)
        step = (hi - lo).clamp_min_(1e-12).div_(_LEVELS)        # [M, 1]
        zp = torch.round(-lo / step)
        q = (x / step).add_(zp).round_().clamp_(0, _LEVELS).to(torch.uint8)
        acc = torch.ops.onednn.qlinear_pointwise(q, 1.0, 0, self.packed, self.scale, self.zeros, None, 1.0, 0,
                                                 torch.float32, "none", [], "")
        y = torch.addmm(self.bias, step * zp, self.wsum[None, :], alpha=-1).addcmul_(acc, step)
        return y.view(*shape[:-1], self.out_features)


def quantize_encoder(model: nn.Module) -> nn.Module:
    """Switch a BertEncoder's linear layers to int8 in place (see the module docstring for which);
    their float32 weights, and prepacked copies of them, are dropped."""
    for layer in model.encoder.layer:
        for m in (layer.attention.self, layer.attention.output, layer.intermediate):
            m.packed = None
        sa = layer.attention.self
        sa.int8 = Int8Linear(*sa.qkv_weights())
        sa.query = sa.key = sa.value = None
        sa._fused = None
        out = layer.attention.output
        out.int8 = Int8Linear(out.dense.weight, out.dense.bias)
        out.dense = None
        layer.intermediate.dense = Int8Linear(layer.intermediate.dense.weight, layer.intermediate.dense.bias)
    return model


def precision_of(meta: dict[str, Any]) -> str:
    return str(meta.get("precision", "float32"))


def check_supported(meta: dict[str, Any], device: str) -> None:
    """An int8 bundle is a native BERT-family embedding bundle and runs on CPU only."""
    embeds = bool(meta.get("fixtures")) and all("embedding" in fx for fx in meta["fixtures"])
    if not embeds or meta.get("encoder") or meta.get("family") not in INT8_FAMILIES:
        raise BundleError(f"precision int8 covers native {', '.join(INT8_FAMILIES)} embedding models; this one is "
                          f"task {meta.get('task')!r}, family {meta.get('family')!r}: import it in float32")
    if device != "cpu":
        raise BundleError(f"this bundle is int8, a CPU precision; run it with device cpu (not {device!r}), or "
                          "import the model again in float32 for CUDA")


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1) + 1e-12)


def int8_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """bundle.json of the int8 variant of a float32 embed bundle `meta` (before its gate)."""
    check_supported(meta, "cpu")
    return {**meta, "precision": "int8", "precision_gate": {"min_cosine": MIN_COSINE}}


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
