"""MKL-prepacked weights for a CPU float32 decoder's small-batch matmuls, kept only where they pay.

On CPU with MKL, small-batch matmuls (decode, short prefills) may run against prepacked weights
(`pack_weights`): where MKL repacks each weight matrix at every call, that costs more than the
multiplication for a few rows (SmolLM2-135M, 1 thread, an Intel CPU: a decode step at 8 rows 201 ->
132 ms). Elsewhere (an AMD EPYC here: plain and packed equally fast for the layers' projections) the
packed copy, 2 to 21 times the weight's size, is only memory, so it is kept only for the weight
shapes measured faster, within a memory budget (PACKED_BUDGET), and what was measured is
remembered per machine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchinf.config import settings

PACKED_MAX_ROWS = 128   # above this many rows MKL's own packing is amortised and plain sgemm is as fast


class Linear(nn.Linear):
    """nn.Linear that multiplies small batches against a prepacked copy of its weight when it has one."""

    packed: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is None or x.numel() > PACKED_MAX_ROWS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, self.bias, rows.shape[0])
        return y.view(*x.shape[:-1], self.out_features)


PACKED_WIN = 0.85       # a packed copy is kept when decode-sized products take at most this share of the plain time
# ... and the packed copies together take at most this share of the model's weights' memory: on a
# Xeon (AMX) packing paid for SmolLM2-135M's vocabulary, down, q and o projections one product at a
# time (0.46-0.87x the plain time at 8 and 64 rows) but not for a whole generate job (200.5 against
# 200.0 tokens/s), where the copies took 819 MiB more across its two worker processes
PACKED_BUDGET = 0.25
PACKED_ROWS = (8, 64)   # ... at each of these row counts (a drain tail and a full batch)


def pack_weights(model: nn.Module) -> bool:
    """Give a Linear of a CPU float32 model an MKL-packed weight where this torch build has MKL,
    the packed product equals the plain one and is clearly faster on this machine for that weight's
    shape (`packing_pays`, decided per distinct shape), within PACKED_BUDGET -> whether any was
    packed. A packed copy costs 2 to 21 times its weight's memory, so the shapes that pay are
    packed cheapest first while their copies fit the budget (every Linear of a shape or none).
    BATCHINF_PACK_WEIGHTS=0 turns packing off."""
    if not settings().pack_weights or not torch.backends.mkl.is_available() \
            or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return False
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears or any(m.weight.device.type != "cpu" or m.weight.dtype != torch.float32 for m in linears):
        return False
    gen = torch.Generator().manual_seed(0)
    shapes: dict[tuple[int, int], list[Linear]] = {}
    for m in linears:
        shapes.setdefault(tuple(m.weight.shape), []).append(m)
    known = _PackingMemory()
    paying: list[tuple[int, list[Linear]]] = []       # (bytes of the shape's packed copies, its Linears)
    with torch.no_grad():
        for shape, group in shapes.items():
            seen = known.get(shape)
            if seen is None:
                m = group[0]
                pays = packing_pays(m, gen) and _packed_equals_plain(m, gen)
                seen = known.put(shape, pays, _packed_bytes(m) if pays else 0)
            if seen[0]:
                paying.append((seen[1] * len(group), group))
        budget = PACKED_BUDGET * sum(m.weight.nbytes for m in linears)
        packed = []
        for cost, group in sorted(paying, key=lambda p: p[0]):
            if cost > budget:
                break
            budget -= cost
            packed += [(m, torch.ops.mkl._mkl_reorder_linear_weight(m.weight, PACKED_MAX_ROWS)) for m in group]
    for m, w in packed:
        m.packed = w
    return bool(packed)


def _packed_bytes(m: nn.Linear) -> int:
    return torch.ops.mkl._mkl_reorder_linear_weight(m.weight, PACKED_MAX_ROWS).nbytes


class _PackingMemory:
    """What `packing_pays` measured on this machine, and the packed copy's size, per weight shape,
    remembered in $BATCHINF_HOME/cache/packing.json: measuring the shapes of a 135M model took 3 s
    of each worker's load on the 2-core machine (and two workers timing at once disturb each other),
    for an answer that depends only on the CPU, the torch build and the thread count."""

    def __init__(self) -> None:
        self.path = settings().home / "cache" / "packing.json"
        self.prefix = f"{torch.__version__}|{_cpu_model()}|{torch.get_num_threads()}|{PACKED_ROWS}|{PACKED_WIN}|"
        try:
            self.seen: dict[str, list] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.seen = {}

    def get(self, shape: tuple[int, ...]) -> tuple[bool, int] | None:
        value = self.seen.get(self.prefix + "x".join(map(str, shape)))
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], bool) and isinstance(value[1], int):
            return value[0], value[1]
        return None     # never measured, or remembered before sizes were

    def put(self, shape: tuple[int, ...], pays: bool, nbytes: int) -> tuple[bool, int]:
        self.seen[self.prefix + "x".join(map(str, shape))] = [pays, nbytes]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(self.seen, indent=0, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:     # a read-only home: measured again next time
            pass
        return pays, nbytes


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + "|" + torch.backends.cpu.get_cpu_capability()
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def _packed_equals_plain(m: nn.Linear, gen: torch.Generator) -> bool:
    """One packed layout serves every row count: verify it does, for this weight."""
    w = torch.ops.mkl._mkl_reorder_linear_weight(m.weight, PACKED_MAX_ROWS)
    for rows in (1, 5, 64):
        x = torch.randn(rows, m.in_features, generator=gen)
        got = torch.ops.mkl._mkl_linear(x, w, m.weight, None, rows)
        if not torch.allclose(got, F.linear(x, m.weight), rtol=1e-4, atol=1e-4):
            return False
    return True


def packing_pays(linear: nn.Linear, gen: torch.Generator, reps: int = 5) -> bool:
    """Whether this machine multiplies decode-sized batches (each of PACKED_ROWS) faster against a
    packed copy of the weight than against the weight itself: the best of `reps` alternated timings
    of each. Requiring the win at every row count keeps a timing disturbed by other work on the
    machine from buying a copy that does not pay."""
    packed = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight, PACKED_MAX_ROWS)
    for rows in PACKED_ROWS:
        x = torch.randn(rows, linear.in_features, generator=gen)
        best = {"plain": float("inf"), "packed": float("inf")}
        for _ in range(reps):
            for name, fn in (("plain", lambda: F.linear(x, linear.weight)),
                             ("packed", lambda: torch.ops.mkl._mkl_linear(x, packed, linear.weight, None, rows))):
                t0 = time.perf_counter()
                for _ in range(max(1, 32 // rows)):     # a load pays for this: the same work at each row count
                    fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        if best["packed"] > PACKED_WIN * best["plain"]:
            return False
    return True
