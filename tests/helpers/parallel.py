"""How the suite is spread over pytest-xdist's processes (`--dist loadgroup` in .ci/run; the hook
is in tests/conftest.py): a module's tests in one process, so its module fixtures (servers,
converted models, the vllm venv's reports) are built once, except the benchmarks' smoke runs, each
minutes long, which are spread (in one process they would be the run's last straggler).

pytest-xdist's own loadgroup reads a test's group from an `@group` suffix that its worker appends
to the node id; since pytest 9.2 (structured node ids) that suffix is silently lost, so every test
was a unit of its own: a module's tests ran in all processes and its module fixtures were built in
each (the vllm engine's report, minutes long, three times a CI run). The units here are taken from
the node ids themselves, whatever pytest does to them."""

from __future__ import annotations

from typing import Any

# modules whose tests share nothing costly and each run for minutes: spread over the processes
UNGROUPED = {"tests/integration/test_benchmarks.py"}
# handed out first: the directories whose tests start processes, servers and models (minutes a
# module), before the many short unit modules that fill the processes' ends evenly
FIRST = ("tests/integration/", "tests/chaos/")


def work_unit(nodeid: str) -> str:
    """A test's unit of work: its module, or the test itself in an UNGROUPED module."""
    module = nodeid.split("::", 1)[0]
    return nodeid if module in UNGROUPED else module


def work_order(scope: str) -> int:
    """0 for an integration or chaos module, 1 for a benchmark's smoke run (minutes each: not left
    to the end, nor first, when some wait on llama-server and the vllm venv that CI builds in the
    background), 2 for the rest."""
    return 1 if "::" in scope else 0 if scope.startswith(FIRST) else 2


def module_scheduler(config: Any, log: Any) -> Any:
    """An xdist scheduler handing out work_unit()'s units in work_order(), within each as xdist
    orders them (more tests first, unless --no-loadscope-reorder)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self._ordered:                      # the queue is complete by the first call
                units = sorted(self.workqueue.items(), key=lambda unit: work_order(unit[0]))
                self.workqueue.clear()
                self.workqueue.update(units)
                self._ordered = True
            super()._assign_work_unit(node)

    return ModuleScheduling(config, log)
