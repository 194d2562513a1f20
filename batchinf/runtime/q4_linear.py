"""A decoder's projections kept 4-bit in memory where their float32 weights are exact Q4_1 blocks
(BATCHINF_Q4_WEIGHTS=1; off by default, because it is slower).

A bundle imported from a Q4_1 GGUF stores float32 weights in which every block of 32 is exactly
`d * q + m` (float16 `d` and `m`, `q` in 0..15). `q4_1_blocks` recovers the blocks bit for bit at
load: the block's minimum is `m` (the quantiser puts it at q = 0), `(max - min) / 15` rounded to
float16 is `d`, and the weight is kept 4-bit only if `d * q + m` gives back every float32 value.
A `Q4Linear` holds 0.75 bytes a weight instead of 4 (packed nibbles, float32 `d` and `m`). Its
forward expands the blocks into a float32 scratch buffer (a small C kernel, compiled once per
machine with the system's C compiler; `d * q` is exact in float32, a float16 times a 4-bit
integer, so its one rounding is the import's) and runs
the same `F.linear` on the same float32 values as the float32 model: the outputs are identical.
The expansion is paid at every call (docs/performance/generate_vs_llama_server.md): memory for
time, for a machine where the float32 weights do not fit.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger("batchinf.runtime")

BLOCK = 32
KERNEL = r"""
#include <stdint.h>
/* Q4_1 blocks of 32: w[j] = d*q[j] + m; qs: 16 bytes a block, element j in the low nibble of
   byte j, element j+16 in its high nibble. */
void q4_1_expand(const uint8_t *restrict qs, const float *restrict d, const float *restrict m,
                 float *restrict out, int64_t first, int64_t count) {
    for (int64_t b = first; b < first + count; b++) {
        const uint8_t *q = qs + 16 * b;
        float *o = out + 32 * b;
        const float db = d[b], mb = m[b];
        for (int j = 0; j < 16; j++) {
            o[j] = db * (float)(q[j] & 15) + mb;
            o[j + 16] = db * (float)(q[j] >> 4) + mb;
        }
    }
}
"""
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")


def q4_1_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """float32 [out, in] -> (nibbles uint8 [blocks, 16], d float32 [blocks], m float32 [blocks]) when
    every block of 32 along `in` is exactly Q4_1's `d * q + m`; else None."""
    if w.dtype != np.float32 or w.ndim != 2 or w.shape[1] % BLOCK:
        return None
    b = w.reshape(-1, BLOCK)
    m = b.min(1)
    d = ((b.max(1) - m) / np.float32(15)).astype(np.float16).astype(np.float32)
    if not (np.isfinite(d).all() and np.isfinite(m).all() and (m.astype(np.float16) == m).all()):
        return None
    safe = np.where(d == 0, np.float32(1), d)
    q = np.clip(np.rint((b - m[:, None]) / safe[:, None]), 0, 15).astype(np.uint8)
    if not np.array_equal(d[:, None] * q.astype(np.float32) + m[:, None], b):
        return None
    return q[:, :16] | (q[:, 16:] << 4), d, m


class Q4Linear(nn.Module):
    """A Linear whose weight is Q4_1 blocks, expanded to float32 at each call."""

    def __init__(self, blocks: tuple[np.ndarray, np.ndarray, np.ndarray], out_features: int, in_features: int,
                 bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("nibbles", torch.from_numpy(blocks[0]))
        self.register_buffer("d", torch.from_numpy(blocks[1]))
        self.register_buffer("m", torch.from_numpy(blocks[2]))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def weight_float32(self) -> Tensor:
        """The float32 weight in this thread's scratch buffer (valid until its next expansion)."""
        out = _scratch(self.out_features * self.in_features)
        _expand(self.nibbles, self.d, self.m, out)
        return out.view(self.out_features, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight_float32(), self.bias)


def keep_q4(model: nn.Module, linear_type: type[nn.Linear] = nn.Linear, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Swap each `linear_type` submodule of a CPU float32 model whose weight is exact Q4_1 blocks for
    a Q4Linear (not those named in `skip`: the vocabulary projection, which is also the embedding
    when they are tied) -> how many were swapped. The float32 pages of the swapped weights are handed
    back to the kernel (they are views of the bundle file's private map: nothing was written)."""
    if kernel() is None:
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not linear_type or name in skip or child.weight.dtype != torch.float32 \
                    or child.weight.device.type != "cpu":
                continue
            blocks = q4_1_blocks(child.weight.detach().numpy())
            if blocks is None:
                continue
            setattr(parent, name, Q4Linear(blocks, child.out_features, child.in_features,
                                           None if child.bias is None else child.bias.detach()))
            _hand_back(child.weight)
            swapped += 1
    return swapped


def _hand_back(t: Tensor) -> None:
    """MADV_DONTNEED over the whole pages of `t` where it lies in a file's map (runtime/weights.py's
    private map of the bundle file, never written: a page is read again from the file if anything
    touches it). Anonymous memory is left alone: there the call would zero it, and it is freed with
    the tensor anyway."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end > start and _in_file_map(start, end):
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)


def _in_file_map(start: int, end: int) -> bool:
    """Whether [start, end) lies inside one mapping of a file (an inode), per /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                if lo <= start and end <= hi:
                    return fields[4] != "0"
    except OSError:
        pass
    return False


_local = threading.local()


def _scratch(n: int) -> Tensor:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _local.buf = torch.empty(n, dtype=torch.float32)
    return buf[:n]


def _expand(nibbles: Tensor, d: Tensor, m: Tensor, out: Tensor) -> None:
    fn, blocks = kernel(), d.numel()
    threads = max(1, torch.get_num_threads())
    if threads == 1 or blocks < 4096:
        fn(nibbles.data_ptr(), d.data_ptr(), m.data_ptr(), out.data_ptr(), 0, blocks)
        return
    step = -(-blocks // threads)
    list(_pool(threads).map(lambda first: fn(nibbles.data_ptr(), d.data_ptr(), m.data_ptr(), out.data_ptr(),
                                             first, min(step, blocks - first)), range(0, blocks, step)))


@lru_cache(maxsize=None)
def _pool(threads: int):  # noqa: ANN202 -- a ThreadPoolExecutor; ctypes releases the GIL for each call
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(threads, thread_name_prefix="batchinf-q4")


@lru_cache(maxsize=1)
def kernel() -> ctypes._CFuncPtr | None:
    """The expansion kernel, built once per machine (source, flags and CPU in its name) under
    $BATCHINF_HOME/cache/kernels; None where no C compiler builds it (the weights stay float32)."""
    from batchinf.config import settings
    from batchinf.engines.replayed import cpu_stamp

    stamp = hashlib.sha256((KERNEL + " ".join(FLAGS) + cpu_stamp()).encode()).hexdigest()[:16]
    path = settings().home / "cache" / "kernels" / f"q4_1-{stamp}.so"
    if not path.is_file():
        try:
            _build(path)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("Q4_1 weights stay float32: the expansion kernel did not build (%s); "
                        "install a C compiler (cc) or unset BATCHINF_Q4_WEIGHTS", exc)
            return None
    fn = ctypes.CDLL(str(path)).q4_1_expand
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
    fn.restype = None
    return fn


def _build(path: Path) -> None:
    from batchinf.config import settings

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / "q4_1.c", Path(tmp) / "q4_1.so"
        src.write_text(KERNEL)
        cc = settings().c_compiler
        r = subprocess.run([cc, *FLAGS, "-o", str(lib), str(src)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise subprocess.SubprocessError(f"{cc} exited {r.returncode}: {r.stderr.strip()[-500:]}")
        os.replace(lib, path)
