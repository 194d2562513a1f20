"""The int8 precision (runtime/int8.py) as an ONNX graph: the optimised float32 export rewritten so
that each projection of the encoder's layers computes what native's `Int8Linear` computes.

Why not ONNX Runtime's dynamic quantizer: it quantises each activation tensor with one scale for
the whole batch, so a record's vector depends on the records beside it, and on BERT-family
activations (a few large channels) it loses too much: all-MiniLM-L6-v2 fell to cosine 0.987 of
the float32 fixtures (0.994 with SmoothQuant's rescaling), below the int8 gate (0.995).

Each rewritten projection y = x W (+ bias) (+ residual), x [M, K] one row per token:
- the row's step and zero point: lo = min(x_i, 0), hi = max(x_i, 0), step_i = (hi - lo) / 254,
  zp_i = round(-lo / step_i) (`_STEPS`, as native);
- q = QuantizeLinear(x, step, zp, axis=0): u8, one scale per row;
- the GEMM `MatMulIntegerToFloat` (u8 x s8, MLAS's VNNI/AVX2 kernels) over q with T more columns
  that each hold zp_i, against the weights int8 per output channel (within the scheme's ±wmax)
  with T more rows that sum to -sum_k W8[k, j]: so its integer accumulator is (q_i - zp_i) . W8_j
  exactly, without a per-row zero point (which ORT's kernels do not take), and it scales it by
  the channel's weight scale;
- times step_i, plus the bias and the residual the projection had.
The scheme decides as native does: `vnni` all four projections of a layer, weights ±127; `avx2`
weights ±63 and the FFN output projection (the one fed by the GELU) left in float32."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from batchinf.runtime.int8 import _STEPS, SCHEMES, int8_weights

LAYER = re.compile(r"/encoder/layer\.\d+/")       # the encoder layers' scope in the exported graph's node names
RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Erf", "Tanh", "Pow", "Sigmoid", "Gelu", "BiasGelu", "FastGelu", "Relu")


class _Rewriter:
    def __init__(self, graph: Any, wmax: int) -> None:
        from onnx import numpy_helper

        self.wmax = wmax
        self.inits = {i.name: i for i in graph.initializer}
        self.to_array = numpy_helper.to_array
        self.from_array = numpy_helper.from_array
        self.added: list[Any] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.added.append(self.from_array(value, name))
        return name

    def weight(self, node: Any) -> tuple[np.ndarray, str | np.ndarray | None] | None:
        """(W [K, N] float32, what is added to x W: an initializer's array, a tensor's name or None),
        or None where `node` is not a projection by a constant weight."""
        from onnx import helper

        if len(node.input) < 2 or node.input[1] not in self.inits:
            return None
        w = self.to_array(self.inits[node.input[1]]).astype(np.float32)
        if node.op_type == "MatMul":
            return (w, None) if w.ndim == 2 else None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0 or attrs.get("transA", 0):
            return None
        w = w.T if attrs.get("transB", 0) else w
        added: str | np.ndarray | None = None
        if len(node.input) > 2 and node.input[2]:
            c = node.input[2]
            added = self.to_array(self.inits[c]).astype(np.float32) if c in self.inits else c
        return w, added

    def projection(self, node: Any, w: np.ndarray, added: str | np.ndarray | None) -> list[Any]:
        """The nodes that compute `node`'s output in int8 (module docstring)."""
        from onnx import TensorProto
        from onnx.helper import make_node as mk

        k, n = w.shape
        w8, scale = int8_weights(w, self.wmax)                       # [K + T, N] with the zero-point rows, [N]
        p = "int8" + node.name.replace("/", "_") + "_"
        x, y = node.input[0], node.output[0]
        c = {name: self.const(p + name, v) for name, v in {
            "w": w8, "scale": scale,
            "rows": np.array([-1, k], np.int64), "flat": np.array([-1], np.int64),
            "zero": np.array(0, np.float32), "tiny": np.array(1e-12, np.float32),
            "steps": np.array(_STEPS, np.float32), "one": np.array(1, np.float32),
            "zp_tile": np.array([1, w8.shape[0] - k], np.int64), "first": np.array([0], np.int64),
            "n": np.array([n], np.int64)}.items()}
        nodes = [
            mk("Reshape", [x, c["rows"]], [p + "x"]),
            mk("ReduceMin", [p + "x"], [p + "min"], axes=[1], keepdims=1),
            mk("Min", [p + "min", c["zero"]], [p + "lo"]),
            mk("ReduceMax", [p + "x"], [p + "max"], axes=[1], keepdims=1),
            mk("Max", [p + "max", c["zero"]], [p + "hi"]),
            mk("Sub", [p + "hi", p + "lo"], [p + "range"]),
            mk("Max", [p + "range", c["tiny"]], [p + "range1"]),
            mk("Div", [p + "range1", c["steps"]], [p + "step"]),                  # [M, 1]
            mk("Div", [p + "lo", p + "step"], [p + "lo_steps"]),
            mk("Neg", [p + "lo_steps"], [p + "neg_lo"]),
            mk("Round", [p + "neg_lo"], [p + "zp"]),
            mk("Cast", [p + "zp"], [p + "zp8"], to=TensorProto.UINT8),
            mk("Reshape", [p + "step", c["flat"]], [p + "step_m"]),
            mk("Reshape", [p + "zp8", c["flat"]], [p + "zp_m"]),
            mk("QuantizeLinear", [p + "x", p + "step_m", p + "zp_m"], [p + "q"], axis=0),
            mk("Tile", [p + "zp8", c["zp_tile"]], [p + "zp_cols"]),
            mk("Concat", [p + "q", p + "zp_cols"], [p + "q_zp"], axis=1),
            mk("MatMulIntegerToFloat", [p + "q_zp", c["w"], c["one"], c["scale"]], [p + "acc"],
               domain="com.microsoft"),
            mk("Mul", [p + "acc", p + "step"], [p + "y"]),
        ]
        out = p + "y"
        if isinstance(added, np.ndarray):
            nodes.append(mk("Add", [out, self.const(p + "bias", added)], [p + "y_bias"]))
            out = p + "y_bias"
        elif isinstance(added, str):
            nodes.append(mk("Add", [out, added], [p + "y_added"]))
            out = p + "y_added"
        nodes += [mk("Shape", [x], [p + "x_shape"]),
                  mk("Slice", [p + "x_shape", c["first"], c["flat"]], [p + "lead"]),
                  mk("Concat", [p + "lead", c["n"]], [p + "y_shape"], axis=0),
                  mk("Reshape", [out, p + "y_shape"], [y])]
        return nodes


def quantize(fp32: Path, out: Path, scheme: str) -> dict[str, Any]:
    """The graph at `fp32` with its encoder layers' projections in int8 under `scheme`, written to `out`."""
    import onnx
    from onnx import helper

    s = SCHEMES[scheme]
    model = onnx.load(str(fp32))
    rw = _Rewriter(model.graph, s.wmax)
    producer = {o: node for node in model.graph.node for o in node.output}

    def fed_by_projection(node: Any, depth: int = 8) -> bool:
        """Whether `node`'s input is an elementwise function of a projection's output (an
        activation between them): the FFN output projection, fed by the GELU of the FFN input's."""
        todo, seen = [node.input[0]], set()
        while todo and depth > 0:
            depth -= 1
            src = producer.get(todo.pop())
            if src is None or src.name in seen:
                continue
            seen.add(src.name)
            if src.op_type in ("MatMul", "Gemm") and rw.weight(src) is not None:
                return True
            if src.op_type in ELEMENTWISE:
                todo += [i for i in src.input if i in producer]
            elif src.op_type in RESHAPES:
                todo.append(src.input[0])
        return False

    nodes, rewritten = [], 0
    for node in model.graph.node:
        found = rw.weight(node) if node.op_type in ("MatMul", "Gemm") and LAYER.search(node.name) else None
        if found is None or (not s.ffn_output and fed_by_projection(node)):
            nodes.append(node)
            continue
        nodes += rw.projection(node, *found)
        rewritten += 1
    if not rewritten:
        raise ValueError(f"{fp32}: no projection of an encoder layer found to quantise")
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(rw.added)
    used = {i for node in model.graph.node for i in node.input}
    kept = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(out))
    return {"quantizer": f"batchinf per-token int8 (runtime/onnx_int8.py, scheme {scheme}): u8 activations "
                         f"per row, int8 weights per channel, {rewritten} projections, MatMulIntegerToFloat"}
