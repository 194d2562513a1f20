"""Every task strategy can be called the way plan, execute and verify call the protocol: each
method it overrides accepts the parameters `Task` declares (a merge once left one behind)."""

from __future__ import annotations

import inspect

import pytest

from batchinf.tasks import TASKS
from batchinf.tasks.base import Task


def _params(fn: object) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_overrides_accept_the_protocols_parameters(name: str) -> None:
    task = type(TASKS[name])
    for attr, base in vars(Task).items():
        if not inspect.isfunction(base) or attr.startswith("__") or attr not in vars(task):
            continue
        assert _params(vars(task)[attr]) == _params(base), (
            f"{task.__name__}.{attr}{inspect.signature(vars(task)[attr])} does not match "
            f"Task.{attr}{inspect.signature(base)}")
