"""The intra-op threads a worker process computes with. The worker sets the count once
(`set_worker_threads`); it reaches PyTorch only when a bundle that runs on PyTorch loads
(`use_torch_threads`), so a worker whose engine needs no PyTorch (CTranslate2's Whisper) never
pays for importing it."""

from __future__ import annotations

import os

_threads: int | None = None


def set_worker_threads(threads: int) -> None:
    global _threads
    _threads = threads


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
