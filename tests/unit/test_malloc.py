"""runtime/malloc.py: a process that loads a model keeps freed memory instead of faulting it in
again on every batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from batchinf.runtime.malloc import keep_freed_memory

# allocate, touch every page of and free a 64 MiB buffer 20 times; print the minor page faults it took
_CYCLE = """
import ctypes, json, resource, sys
from batchinf.runtime.malloc import keep_freed_memory
took = keep_freed_memory(int(sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    buf = bytearray(64 << 20)
    buf[::4096] = b"x" * (16 << 10)    # every page touched
    del buf
print(json.dumps({"took": took, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _cycle(limit: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CYCLE, str(limit)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_memory_is_kept_and_not_faulted_in_again() -> None:
    pages = (64 << 20) // 4096
    default, kept = _cycle(0), _cycle(1 << 30)
    assert default["took"] is False and kept["took"] is True
    assert default["faults"] > 10 * pages          # glibc's default: mmap and unmap each time
    assert kept["faults"] < 3 * pages              # the first allocation faults it in, the rest reuse it


def test_off_is_a_no_op() -> None:
    assert keep_freed_memory(0) is False
