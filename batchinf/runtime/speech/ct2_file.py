"""CTranslate2's model.bin, read without CTranslate2: its header (format version, model spec)
and its variables (name, shape, dtype, raw data). Import reads the weights' dtype from it; the
parity test reads the weights into a reference model. Never executes anything: it is a flat
binary layout, not a pickle."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}
DTYPE_NAMES = {0: "float32", 1: "int8", 2: "int16", 3: "int32", 4: "float16", 5: "bfloat16"}


def _string(fh: BinaryIO) -> str:
    (n,) = struct.unpack("<H", fh.read(2))
    return fh.read(n).rstrip(b"\0").decode("utf-8")


def header(fh: BinaryIO) -> tuple[int, str, int, int]:
    """(format version, spec name, spec revision, variable count)."""
    (version,) = struct.unpack("<I", fh.read(4))
    spec = _string(fh) if version >= 2 else ""
    (revision,) = struct.unpack("<I", fh.read(4)) if version >= 2 else (1,)
    (count,) = struct.unpack("<I", fh.read(4))
    return version, spec, revision, count


def variables(path: Path, *, data: bool = True) -> Iterator[tuple[str, tuple[int, ...], int, bytes | None]]:
    """(name, shape, dtype id, raw little-endian bytes or None) of every variable, in file order."""
    with path.open("rb") as fh:
        _, _, _, count = header(fh)
        for _ in range(count):
            name = _string(fh)
            rank = fh.read(1)[0]
            shape = struct.unpack(f"<{rank}I", fh.read(4 * rank)) if rank else ()
            dtype = fh.read(1)[0]
            (nbytes,) = struct.unpack("<I", fh.read(4))
            if data:
                yield name, tuple(shape), dtype, fh.read(nbytes)
            else:
                fh.seek(nbytes, 1)
                yield name, tuple(shape), dtype, None


def weights_dtype(path: Path) -> str:
    """The dtype most of the model's weight bytes are stored in (float16 for a float16 export)."""
    by: dict[int, int] = {}
    for _, shape, dtype, _ in variables(path, data=False):
        if len(shape) >= 2:
            by[dtype] = by.get(dtype, 0) + int(np.prod(shape))
    return DTYPE_NAMES.get(max(by, key=by.__getitem__), "unknown") if by else "unknown"


def array(shape: tuple[int, ...], dtype: int, raw: bytes) -> np.ndarray:
    """A variable as float32 numpy (bfloat16 widened)."""
    if DTYPES[dtype] == "bfloat16":
        u = np.frombuffer(raw, np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    return np.frombuffer(raw, DTYPES[dtype]).reshape(shape).astype(np.float32)
