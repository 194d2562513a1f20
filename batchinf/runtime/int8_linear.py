"""Native's int8 projections (the precision: runtime/int8.py): PyTorch's own x86 int8 kernels
(`torch.ops.onednn.qlinear_*`), fed plain u8/s8 tensors; the row scales, zero points and bias are
applied to their float32 output in one pass."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchinf.runtime import int8


class Int8Linear(nn.Module):
    """y = x W^T + b (+ residual) with int8 per-channel weights and per-token u8 activations.

    Each row x_i is quantised over [min(x_i, 0), max(x_i, 0)] in 254 steps: q_i = x_i / step_i +
    zp_i. The GEMM itself subtracts the zero points: q carries T more columns that each hold zp_i,
    and W8 T more columns, each within ±wmax, that sum to -sum_k W8[j, k]; so acc = (q_i - zp_i) . W8_j
    and y_i = step_i * acc_i + b is one pass over the output."""

    def __init__(self, weight: Tensor, bias: Tensor | None, wmax: int) -> None:
        super().__init__()
        w8, scale = int8.int8_weights(weight.detach().float().numpy().T, wmax)           # [K + T, N], [N]
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.zp_columns = w8.shape[0] - self.in_features
        self.packed = torch.ops.onednn.qlinear_prepack(torch.from_numpy(w8.T.copy()), None)
        self.scale = torch.from_numpy(scale)
        self.zeros = torch.zeros(self.out_features, dtype=torch.int64)
        self.bias = bias.detach().float() if bias is not None else torch.zeros(self.out_features)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        shape, k = x.shape, self.in_features
        x = x.reshape(-1, k)                                                             # [M, K]
        lo, hi = x.amin(-1, keepdim=True).clamp_max_(0), x.amax(-1, keepdim=True).clamp_min_(0)
        step = (hi - lo).clamp_min_(1e-12).div_(int8._STEPS)                            # [M, 1]
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
    s = int8.SCHEMES[scheme]
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
