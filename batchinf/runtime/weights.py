"""Reading a bundle's safetensors weights.

On CPU the tensors are views of one copy-on-write memory map of the (digest-checked, never
rewritten) bundle file instead of copies: the pages come from the page cache, so every worker process
on a machine that loads the same bundle shares one copy of its weights, and pages a model never
reads are never loaded. A tensor written to gets its own pages (MAP_PRIVATE), never the file's.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from batchinf.errors import BundleError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 << 20     # safetensors' own limit


def load_safetensors(path: Path | str, device: str | torch.device = "cpu") -> dict[str, Tensor]:
    """The tensors of one safetensors file: mapped on CPU (shared between processes), read on other
    devices."""
    if torch.device(device).type != "cpu":
        return load_file(path, device=str(torch.device(device)))
    return _mapped(Path(path))


def _mapped(path: Path) -> dict[str, Tensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
            raise BundleError(f"{path} is not a safetensors file (header length {n}); import the model again")
        header = json.loads(f.read(n))
    base, storage = 8 + n, torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
    out: dict[str, Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info["dtype"])
        begin, end = info["data_offsets"]
        shape = list(info["shape"])
        if dtype is None:
            raise BundleError(f"{path}: tensor {name} has dtype {info['dtype']}, which batchinf does not load")
        item = torch.empty(0, dtype=dtype).element_size()
        count = 1
        for d in shape:
            count *= d
        if not 0 <= begin <= end <= size - base or end - begin != count * item:
            raise BundleError(f"{path}: tensor {name}'s offsets {begin}..{end} do not match its shape {shape}; "
                              "the file is damaged: import the model again")
        if (base + begin) % item:     # unaligned for its dtype: a view is impossible, copy this one
            with open(path, "rb") as f:
                f.seek(base + begin)
                out[name] = torch.frombuffer(bytearray(f.read(end - begin)), dtype=dtype).reshape(shape)
        else:
            out[name] = torch.empty(0, dtype=dtype).set_(storage, (base + begin) // item, shape)
    return out
