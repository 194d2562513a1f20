"""CPU tensors whose memory the kernel commits only where they are written, and hands back on
request: the decoder's KV cache (runtime/llama.py)."""

from __future__ import annotations

import math
import mmap
import weakref

import torch
from torch import Tensor


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero tensor whose CPU memory is committed only where it is written: an anonymous private
    map, which the kernel zero-fills a page at a time on first touch (reads of an untouched page see
    the shared zero page). A KV cache sized for every slot's prompt + max_tokens then holds, in
    memory, the positions sequences really reached: answers that stop early leave the rest of their
    slot unmapped. torch.zeros writes, and so commits, all of it. `forget` hands pages back."""
    device = torch.device(device)
    count = math.prod(shape)
    if device.type != "cpu" or count == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: reads of untouched pages map the zero page (a shared map would commit them); the
    # tensor keeps the map alive, and it is unmapped with the tensor
    buf = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(buf, dtype=dtype, count=count).view(shape)
    _LAZY[t.data_ptr()] = buf
    return t


_LAZY: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()   # lazy_zeros' maps


def forget(t: Tensor, index: int) -> None:
    """t[index] (a tensor from lazy_zeros) := zeros, its whole pages handed back to the kernel
    (MADV_DONTNEED: a private anonymous page reads as zero again and is committed on its next
    write); the partial pages at its ends are zeroed in place. Any other tensor: zeroed."""
    row = t[index]
    buf = _LAZY.get(t.data_ptr())
    if buf is None or not row.is_contiguous():
        row.zero_()
        return
    start = row.data_ptr() - t.data_ptr()
    end = start + row.numel() * row.element_size()
    lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if lo >= hi:
        row.zero_()
        return
    buf.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    item = row.element_size()
    flat = t.view(-1)
    flat[start // item:lo // item].zero_()
    flat[hi // item:end // item].zero_()
