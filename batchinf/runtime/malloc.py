"""Keep freed memory in the process instead of giving it back to the kernel after every batch.

glibc serves an allocation above its mmap threshold (128 KiB, rising to at most 32 MiB) with a
fresh mmap and unmaps it on free, so every activation of a batch, tens of MB each, is faulted
in page by page again on the next batch. On the 2-core machine of docs/performance that was
a third of an encoder's time at one torch thread: 13 s of a 38 s benchmark in the kernel, and
1.24x (one thread) to 1.42x (two) the float32 tokens/s once freed blocks stay in the heap.
Raising the mmap and trim thresholds keeps them (as PyTorch's CPU tuning guide gets from
jemalloc or tcmalloc). Called once per process that loads a model; a no-op off glibc.
What a model's load freed (checks, fixture passes) is handed back once it is loaded
(`release_freed_memory`): kept, it only raised the process's footprint for the whole job.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3      # mallopt(3) parameters


@functools.cache
def keep_freed_memory(limit: int) -> bool:
    """Up to `limit` bytes per allocation come from the heap and up to `limit` freed bytes stay
    there (0: glibc's defaults) -> whether glibc took both settings."""
    if limit <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):        # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    limit = min(limit, 2**31 - 1)
    return bool(mallopt(_M_MMAP_THRESHOLD, limit)) and bool(mallopt(_M_TRIM_THRESHOLD, limit))


def release_freed_memory() -> bool:
    """Hand the heap's free memory back to the kernel now (malloc_trim) -> whether any was."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return bool(trim(0))
