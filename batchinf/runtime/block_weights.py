"""A decoder's weights kept as GGUF blocks in memory where their float32 values are exact blocks
(BATCHINF_BLOCK_WEIGHTS).

A bundle imported from a GGUF stores float32 weights in which every block of 32 is exactly what
the file held: Q4_1's `d * q + m` (float16 `d` and `m`, `q` in 0..15) or Q8_0's `d * q` (float16
`d`, `q` a signed byte). The load recovers the blocks bit for bit (`q4_1_blocks`, `q8_0_blocks`:
a weight is kept as blocks only if they give back every float32 value). A `BlockLinear` holds 0.75
(Q4_1) or 1.125 (Q8_0) bytes a weight instead of 4; its forward expands the blocks into a float32
scratch buffer of its thread (a small C kernel, AVX2 where the CPU has it, compiled once per
machine with the system's C compiler; `d * q` is exact in float32, so the one rounding is the
import's) and runs the same `F.linear` on the same float32 values as the float32 model: the
outputs are identical. A tied embedding table is held once, as its vocabulary projection's
blocks (`BlockEmbedding` looks rows up from them). The expansion is paid at every call
(docs/performance/generate_vs_llama_server.md).
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
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline void put8(float *o, __m128i q8, __m256 d, __m256 m) {   /* 8 unsigned bytes -> d*q+m */
    _mm256_storeu_ps(o, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8)), m));
}
#endif
/* Blocks [first, first + count) into out[0 ..); each kernel below.
   Q4_1 blocks of 32: w[j] = d*q[j] + m; qs: 16 bytes a block, element j in the low nibble of
   byte j, element j+16 in its high nibble. d*q is exact in float32, so the fused multiply-add
   rounds as the scalar code does. */
void q4_1_expand(const uint8_t *restrict qs, const float *restrict d, const float *restrict m,
                 float *restrict out, int64_t first, int64_t count) {
    for (int64_t b = first; b < first + count; b++) {
        const uint8_t *q = qs + 16 * b;
        float *o = out + 32 * (b - first);
#if defined(__AVX2__) && defined(__FMA__)
        const __m128i bytes = _mm_loadu_si128((const __m128i *)q), low4 = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        const __m256 vd = _mm256_set1_ps(d[b]), vm = _mm256_set1_ps(m[b]);
        put8(o, lo, vd, vm);
        put8(o + 8, _mm_srli_si128(lo, 8), vd, vm);
        put8(o + 16, hi, vd, vm);
        put8(o + 24, _mm_srli_si128(hi, 8), vd, vm);
#else
        const float db = d[b], mb = m[b];
        for (int j = 0; j < 16; j++) {
            o[j] = db * (float)(q[j] & 15) + mb;
            o[j + 16] = db * (float)(q[j] >> 4) + mb;
        }
#endif
    }
}
/* Q8_0 blocks of 32: w[j] = d*q[j], q signed bytes; exact in float32 (a float16 times an int8). */
void q8_0_expand(const int8_t *restrict qs, const float *restrict d, float *restrict out,
                 int64_t first, int64_t count) {
    for (int64_t b = first; b < first + count; b++) {
        const int8_t *q = qs + 32 * b;
        float *o = out + 32 * (b - first);
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 vd = _mm256_set1_ps(d[b]);
        for (int j = 0; j < 32; j += 8)
            _mm256_storeu_ps(o + j, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j))))));
#else
        for (int j = 0; j < 32; j++)
            o[j] = d[b] * (float)q[j];
#endif
    }
}
"""
SCRATCH_WEIGHTS = 1 << 20   # a weight larger than this is expanded and multiplied a slice of rows at a time
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


def q8_0_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """float32 [out, in] -> (int8 [blocks, 32], d float32 [blocks]) when every block of 32 along
    `in` is exactly Q8_0's `d * q` (float16 `d`; the quantiser puts the largest magnitude at
    q = +-127, so `d` is it / 127); else None."""
    if w.dtype != np.float32 or w.ndim != 2 or w.shape[1] % BLOCK:
        return None
    b = w.reshape(-1, BLOCK)
    d = np.abs(b).max(1) / np.float32(127)
    if not (np.isfinite(d).all() and (d.astype(np.float16).astype(np.float32) == d).all()):
        return None
    safe = np.where(d == 0, np.float32(1), d)
    q = np.clip(np.rint(b / safe[:, None]), -127, 127).astype(np.int8)
    if not np.array_equal(d[:, None] * q.astype(np.float32), b):
        return None
    return q, d


FORMATS = {"q4_1": q4_1_blocks, "q8_0": q8_0_blocks}


def blocks_of(w: Tensor, maps: list[tuple[int, int, bool]] | None = None) -> tuple[str, tuple[np.ndarray, ...]] | None:
    """A CPU float32 weight's GGUF block format and blocks, where it is exactly one of FORMATS'.
    Looked at a slice of rows at a time, each slice's float32 pages handed back once read (the
    recovery's temporaries and the file's pages stay about a slice's size, not a vocabulary's)."""
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.ndim != 2 or w.shape[1] % BLOCK:
        return None
    a, step = w.detach().numpy(), max(1, SCRATCH_WEIGHTS // w.shape[1])
    for fmt, recover in FORMATS.items():
        parts = []
        for first in range(0, a.shape[0], step):
            if (got := recover(a[first:first + step])) is None:
                break
            parts.append(got)
            _hand_back(w[first:first + step], maps)
        else:
            return fmt, tuple(np.concatenate(x) for x in zip(*parts))
    return None


class BlockLinear(nn.Module):
    """A Linear whose weight is GGUF blocks (`fmt`: q4_1, 0.75 bytes a weight; q8_0, 1.125),
    expanded to float32 at each call."""

    def __init__(self, fmt: str, blocks: tuple[np.ndarray, ...], out_features: int, in_features: int,
                 bias: Tensor | None) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.register_buffer("q", torch.from_numpy(blocks[0]))
        self.register_buffer("d", torch.from_numpy(blocks[1]))
        self.register_buffer("m", torch.from_numpy(blocks[2]) if fmt == "q4_1" else None)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def weight_float32(self, first: int = 0, rows: int | None = None) -> Tensor:
        """Rows [first, first + rows) of the float32 weight (all by default) in this thread's scratch
        buffer, valid until its next expansion."""
        rows = self.out_features - first if rows is None else rows
        out = _scratch(rows * self.in_features)
        per_row = self.in_features // BLOCK
        _expand(self, out, first * per_row, rows * per_row)
        return out.view(rows, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        step = max(1, SCRATCH_WEIGHTS // self.in_features)
        if self.out_features <= step:
            return F.linear(x, self.weight_float32(), self.bias)
        # a large weight (a vocabulary projection) a slice of rows at a time: the scratch stays small
        y = x.new_empty(*x.shape[:-1], self.out_features)
        for first in range(0, self.out_features, step):
            rows = min(step, self.out_features - first)
            y[..., first:first + rows] = F.linear(x, self.weight_float32(first, rows),
                                                  None if self.bias is None else self.bias[first:first + rows])
        return y

    def rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` of the float32 weight [*ids.shape, in] (an embedding lookup), the same values."""
        per_row = self.in_features // BLOCK
        shape = (self.out_features, per_row, -1)
        d = self.d.view(shape)[ids]
        if self.fmt == "q8_0":
            w = self.q.view(shape)[ids].float() * d
        else:
            nib = self.q.view(shape)[ids]
            w = torch.cat([nib & 15, nib >> 4], -1).float() * d + self.m.view(shape)[ids]
        return w.reshape(*ids.shape, self.in_features)


class BlockEmbedding(nn.Module):
    """An embedding table held as a BlockLinear's blocks (the vocabulary projection's, when tied)."""

    def __init__(self, table: BlockLinear) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: Tensor) -> Tensor:
        return self.table.rows(ids)


def keep_blocks(model: nn.Module, linear_type: type[nn.Linear] = nn.Linear) -> int:
    """Swap each `linear_type` submodule of a CPU float32 model whose weight is exact GGUF blocks
    for a BlockLinear, and an embedding table that is (the vocabulary projection's, when they are
    tied, for the same blocks) for a BlockEmbedding -> how many weights were swapped. The float32
    pages of the swapped weights are handed back to the kernel (they are views of the bundle
    file's private map: nothing was written)."""
    if kernel() is None:
        return 0
    swapped: dict[int, BlockLinear] = {}        # float32 storage -> its blocks, shared by tied modules
    maps = _mappings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is linear_type or type(child) is nn.Embedding:
                w = child.weight
                found = swapped.get(w.data_ptr())
                if found is None:
                    if (got := blocks_of(w, maps)) is None:
                        continue
                    rows, cols = w.shape
                    bias = getattr(child, "bias", None)
                    found = BlockLinear(*got, rows, cols, None if bias is None else bias.detach())
                    swapped[w.data_ptr()] = found
                setattr(parent, name, found if type(child) is not nn.Embedding else BlockEmbedding(found))
    return len(swapped)


def _hand_back(t: Tensor, maps: list[tuple[int, int, bool]] | None = None) -> None:
    """MADV_DONTNEED over the whole pages of `t` where it lies in a file's map (runtime/weights.py's
    private map of the bundle file, never written: a page is read again from the file if anything
    touches it). Anonymous memory is left alone: there the call would zero it, and it is freed with
    the tensor anyway. `maps`: this process's mappings, read once by a caller handing back many."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-t.data_ptr() // page) * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end > start and _in_file_map(start, end, maps):
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)


def _mappings() -> list[tuple[int, int, bool]]:
    """(start, end, whether a file's) of each mapping of this process, per /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            return [(int(lo, 16), int(hi, 16), fields[4] != "0") for fields in map(str.split, f)
                    for lo, hi in [fields[0].split("-")]]
    except OSError:
        return []


def _in_file_map(start: int, end: int, maps: list[tuple[int, int, bool]] | None = None) -> bool:
    """Whether [start, end) lies inside one mapping of a file (an inode)."""
    return any(lo <= start and end <= hi and is_file for lo, hi, is_file in (maps or _mappings()))


_local = threading.local()


def _scratch(n: int) -> Tensor:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _local.buf = torch.empty(n, dtype=torch.float32)
    return buf[:n]


def _expand(lin: BlockLinear, out: Tensor, first: int, blocks: int) -> None:
    """Blocks [first, first + blocks) of `lin` into `out`, split across this process's torch threads."""
    fn = kernel()[lin.fmt]
    src = [lin.q.data_ptr(), lin.d.data_ptr()] + ([lin.m.data_ptr()] if lin.m is not None else [])
    threads = max(1, torch.get_num_threads())
    if threads == 1 or blocks < 4096:
        fn(*src, out.data_ptr(), first, blocks)
        return
    step, size = -(-blocks // threads), BLOCK * out.element_size()
    list(_pool(threads).map(lambda at: fn(*src, out.data_ptr() + (at - first) * size, at, min(step, first + blocks - at)),
                            range(first, first + blocks, step)))


@lru_cache(maxsize=None)
def _pool(threads: int):  # noqa: ANN202 -- a ThreadPoolExecutor; ctypes releases the GIL for each call
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(threads, thread_name_prefix="batchinf-q4")


@lru_cache(maxsize=1)
def kernel() -> dict[str, ctypes._CFuncPtr] | None:
    """The expansion kernels by block format, built once per machine (source, flags and CPU in its
    name) under $BATCHINF_HOME/cache/kernels; None where no C compiler builds them (the weights stay
    float32)."""
    from batchinf.config import settings
    from batchinf.engines.replayed import cpu_stamp

    stamp = hashlib.sha256((KERNEL + " ".join(FLAGS) + cpu_stamp()).encode()).hexdigest()[:16]
    path = settings().home / "cache" / "kernels" / f"blocks-{stamp}.so"
    if not path.is_file():
        try:
            _build(path)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("GGUF blocks stay float32: the expansion kernel did not build (%s); "
                        "install a C compiler (cc) or set BATCHINF_BLOCK_WEIGHTS=0", exc)
            return None
    lib = ctypes.CDLL(str(path))
    fns = {"q4_1": lib.q4_1_expand, "q8_0": lib.q8_0_expand}
    for fmt, fn in fns.items():
        fn.argtypes = [ctypes.c_void_p] * (4 if fmt == "q4_1" else 3) + [ctypes.c_int64] * 2
        fn.restype = None
    return fns


def _build(path: Path) -> None:
    from batchinf.config import settings

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / "blocks.c", Path(tmp) / "blocks.so"
        src.write_text(KERNEL)
        cc = settings().c_compiler
        r = subprocess.run([cc, *FLAGS, "-o", str(lib), str(src)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise subprocess.SubprocessError(f"{cc} exited {r.returncode}: {r.stderr.strip()[-500:]}")
        os.replace(lib, path)
