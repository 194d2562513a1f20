"""Dequantisation of GGUF (ggml) tensor blocks to float32, vectorised with numpy.

Each dequantiser maps uint8 blocks [n_blocks, bytes_per_block] to floats [n_blocks, elements]. The
float operations are ggml's own (ggml-quants.c `dequantize_row_*`) in the same order and in float32,
so the results are bit-identical to llama.cpp's and to the `gguf` package's reference
(tests/parity/test_gguf_parity.py checks every type). `dequantize` works in chunks of blocks, so a
tensor's scratch memory stays a few times CHUNK_ELEMENTS floats whatever the tensor's size.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

QK_K = 256                  # elements per K-quant super-block
CHUNK_ELEMENTS = 1 << 22    # elements dequantised per pass (scratch of a few × 16 MiB)

Dequant = Callable[[np.ndarray], np.ndarray]
_U8 = np.uint8


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _shifts(*values: int, dtype: type = np.uint8) -> np.ndarray:
    return np.array(values, dtype=dtype)


def _split_nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """[n, k*group] bytes -> [n, k, 2, group]: each group's low nibbles, then its high ones."""
    n = qs.shape[0]
    return (qs.reshape(n, -1, 1, group) >> _shifts(0, 4).reshape(1, 1, 2, 1)) & _U8(0x0F)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: the fifth bits of 32 quants, one little-endian uint32 per block -> uint8 [n, 32]."""
    h = np.ascontiguousarray(qh).view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32).reshape(1, -1)
    return (h & np.uint32(1)).astype(_U8)


# -- 32-element blocks ---------------------------------------------------------------------------

def q8_0(b: np.ndarray) -> np.ndarray:      # f16 d, 32 × int8; x = q * d
    return b[:, 2:].view(np.int8).astype(np.float32) * _f16(b[:, :2])


def q4_0(b: np.ndarray) -> np.ndarray:      # f16 d, 16 bytes of nibbles; x = d * (q - 8)
    q = _split_nibbles(b[:, 2:], 16).reshape(b.shape[0], 32).astype(np.int8) - np.int8(8)
    return _f16(b[:, :2]) * q.astype(np.float32)


def q4_1(b: np.ndarray) -> np.ndarray:      # f16 d, f16 m, 16 bytes of nibbles; x = d * q + m
    q = _split_nibbles(b[:, 4:], 16).reshape(b.shape[0], 32).astype(np.float32)
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _q5(b: np.ndarray, qh_at: int) -> np.ndarray:
    """5-bit quants of a Q5_0/Q5_1 block as uint8 [n, 32]: low nibbles | high bit << 4."""
    high = _fifth_bits(b[:, qh_at:qh_at + 4])
    low = _split_nibbles(b[:, qh_at + 4:], 16).reshape(b.shape[0], 32)
    return low | (high << _U8(4))


def q5_0(b: np.ndarray) -> np.ndarray:      # f16 d, 4 bytes high bits, 16 bytes nibbles; x = d * (q - 16)
    q = _q5(b, 2).astype(np.int8) - np.int8(16)
    return _f16(b[:, :2]) * q.astype(np.float32)


def q5_1(b: np.ndarray) -> np.ndarray:      # f16 d, f16 m, 4 bytes high bits, 16 bytes nibbles; x = d * q + m
    return _f16(b[:, :2]) * _q5(b, 4).astype(np.float32) + _f16(b[:, 2:4])


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def iq4_nl(b: np.ndarray) -> np.ndarray:    # f16 d, 16 bytes of nibbles indexing a non-linear table
    q = IQ4_VALUES[_split_nibbles(b[:, 2:], 16).reshape(b.shape[0], 32)].astype(np.float32)
    return _f16(b[:, :2]) * q


# -- K-quants: 256-element super-blocks ------------------------------------------------------------

def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: twelve bytes -> eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & _U8(0x3F), (md & _U8(0x0F)) | ((d >> _U8(2)) & _U8(0x30))], axis=-1)
    mn = np.concatenate([m & _U8(0x3F), (md >> _U8(4)) | ((m >> _U8(2)) & _U8(0x30))], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def q2_k(b: np.ndarray) -> np.ndarray:      # 16 scale bytes (4-bit scale, 4-bit min), 64 bytes of 2-bit q, f16 d, dmin
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & _U8(0x0F)).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> _U8(4)).astype(np.float32)).reshape(n, 16, 1)
    q = ((qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)) & _U8(3)).reshape(n, 16, 16)
    return (dl * q.astype(np.float32) - ml).reshape(n, QK_K)


def q3_k(b: np.ndarray) -> np.ndarray:      # 32 bytes high-bit mask, 64 bytes of 2-bit q, 12 bytes 6-bit scales, f16 d
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = ((scales[:, :8].reshape(n, 1, 8) >> _shifts(0, 4).reshape(1, 2, 1)) & _U8(0x0F)).reshape(n, 16)
    high = ((scales[:, 8:].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6).reshape(1, 4, 1)) & _U8(3)).reshape(n, 16)
    sc = ((low | (high << _U8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
    dl = (d * sc).reshape(n, 16, 1)
    ql = ((qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)) & _U8(3)).reshape(n, 16, 16)
    qh = ((hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=_U8).reshape(1, 1, 8, 1)) & _U8(1)).reshape(n, 16, 16)
    q = ql.astype(np.int8) - ((qh ^ _U8(1)) << _U8(2)).astype(np.int8)    # a clear mask bit subtracts 4
    return (dl * q.astype(np.float32)).reshape(n, QK_K)


def q4_k(b: np.ndarray) -> np.ndarray:      # f16 d, dmin, 12 bytes scales/mins, 128 bytes of nibbles
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn).reshape(n, 8, 1)
    q = _split_nibbles(b[:, 16:], 32).reshape(n, 8, 32).astype(np.float32)
    return (d * q - dm).reshape(n, QK_K)


def q5_k(b: np.ndarray) -> np.ndarray:      # as Q4_K plus 32 bytes of fifth bits before the nibbles
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn).reshape(n, 8, 1)
    ql = _split_nibbles(b[:, 48:], 32).reshape(n, 8, 32)
    qh = ((b[:, 16:48].reshape(n, 1, 1, 32) >> np.arange(8, dtype=_U8).reshape(1, 1, 8, 1)) & _U8(1)).reshape(n, 8, 32)
    return (d * (ql | (qh << _U8(4))).astype(np.float32) - dm).reshape(n, QK_K)


def q6_k(b: np.ndarray) -> np.ndarray:      # 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, f16 d
    n = b.shape[0]
    d = (_f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)).reshape(n, 16, 1)
    ql = _split_nibbles(b[:, :128], 64).reshape(n, 8, 32)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)) & _U8(3)).reshape(n, 8, 32)
    q = ((ql | (qh << _U8(4))).astype(np.int8) - np.int8(32)).reshape(n, 16, 16)
    return (d * q.astype(np.float32)).reshape(n, QK_K)


def iq4_xs(b: np.ndarray) -> np.ndarray:    # f16 d, u16 high scale bits, 4 bytes low scale bits, 128 bytes nibbles
    n = b.shape[0]
    high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16).reshape(n, 1) >> np.arange(0, 16, 2, dtype=np.uint16)
    low = ((b[:, 4:8].reshape(n, 4, 1) >> _shifts(0, 4).reshape(1, 1, 2)) & _U8(0x0F)).reshape(n, 8)
    sc = (low | ((high.astype(_U8) & _U8(3)) << _U8(4))).astype(np.int8) - np.int8(32)
    dl = (_f16(b[:, :2]) * sc.astype(np.float32)).reshape(n, 8, 1)
    q = IQ4_VALUES[_split_nibbles(b[:, 8:], 16).reshape(n, 8, 32)].astype(np.float32)
    return (dl * q).reshape(n, QK_K)


def _copy_f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float32).copy()      # copy: no view into the mmap


def _bf16(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


# ggml type id -> (name, elements per block, bytes per block, dequantiser). Q8_K is absent on purpose:
# llama.cpp uses it only for intermediate activations, never in a model file.
GGML_TYPES: dict[int, tuple[str, int, int, Dequant]] = {
    0: ("F32", 1, 4, _copy_f32),
    1: ("F16", 1, 2, _f16),
    2: ("Q4_0", 32, 18, q4_0),
    3: ("Q4_1", 32, 20, q4_1),
    6: ("Q5_0", 32, 22, q5_0),
    7: ("Q5_1", 32, 24, q5_1),
    8: ("Q8_0", 32, 34, q8_0),
    10: ("Q2_K", QK_K, 84, q2_k),
    11: ("Q3_K", QK_K, 110, q3_k),
    12: ("Q4_K", QK_K, 144, q4_k),
    13: ("Q5_K", QK_K, 176, q5_k),
    14: ("Q6_K", QK_K, 210, q6_k),
    20: ("IQ4_NL", 32, 18, iq4_nl),
    23: ("IQ4_XS", QK_K, 136, iq4_xs),
    30: ("BF16", 1, 2, _bf16),
}

SUPPORTED_GGUF_TYPES: tuple[str, ...] = tuple(t[0] for t in GGML_TYPES.values())


def dequantize(raw: np.ndarray, ggml_type: int, count: int) -> np.ndarray:
    """`count` float32 values from a tensor's raw bytes (uint8, exactly its blocks), chunk by chunk."""
    _, block, nbytes, fn = GGML_TYPES[ggml_type]
    blocks = raw.reshape(-1, nbytes)
    out = np.empty(count, dtype=np.float32)
    step = max(1, CHUNK_ELEMENTS // block)
    for i in range(0, blocks.shape[0], step):
        out[i * block:(i + step) * block] = fn(blocks[i:i + step]).reshape(-1)
    return out
