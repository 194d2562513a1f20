"""The intra-op threads a worker process computes with, and its lanes (shards it runs at once, a
thread each). The worker sets the counts once (`set_worker_threads`); the threads reach PyTorch
only when a bundle that runs on PyTorch loads (`use_torch_threads`), so a worker whose engine needs
no PyTorch (CTranslate2's Whisper) never pays for importing it."""

from __future__ import annotations

import os

_threads: int | None = None
_lanes = 1


def set_worker_threads(threads: int, lanes: int = 1) -> None:
    """`threads` per lane, `lanes` shards run at once by this worker process (dispatch.worker_main)."""
    global _threads, _lanes
    _threads, _lanes = threads, max(1, lanes)


def lane_share(amount: int) -> int:
    """A lane's share of a per-process `amount` (a generate job's `max_slots`): the lanes of one
    process together hold what one lane alone would."""
    return max(1, amount // _lanes)


def worker_threads() -> int:
    """The worker's thread count (outside a worker: the machine's cores)."""
    return _threads or os.cpu_count() or 1


def use_torch_threads() -> None:
    """Give PyTorch the worker's thread count, one inter-op thread (before a model loads)."""
    if _threads is None:
        return
    import torch

    torch.set_num_threads(_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:    # parallel work already ran in this process: the count is fixed by then
        pass


def cuda_possible() -> bool:
    """Whether this host may have CUDA at all (an NVIDIA device node), asked without importing PyTorch."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"))
