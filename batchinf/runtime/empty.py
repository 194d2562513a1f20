"""Building a model's modules without computing the weights its checkpoint replaces."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

# what torch's built-in modules call from reset_parameters()
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                 "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


def _keep(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


@contextmanager
def empty_weights() -> Iterator[None]:
    """Modules built inside have their parameters on the meta device, uninitialised; the loader
    then assigns every one from the checkpoint (`load_state_dict(..., assign=True)`). Skipping the
    initialisers saves more than their work: initialising a meta tensor runs torch's Python
    reference kernels, whose first use imports torch._dynamo, about a second of every worker
    process's start-up."""
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    for name in _INITIALISERS:
        setattr(nn.init, name, _keep)
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
