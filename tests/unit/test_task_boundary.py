"""The task strategy boundary: only batchinf/tasks/ may branch on a task's name. Everywhere else
the job's task is looked up in the registry (`get_task(name)`) and asked, never compared."""

from __future__ import annotations

import ast

from batchinf.tasks import TASKS
from tests.helpers.imports import ROOT, module_files

TASK_NAMES = set(TASKS)


def _branches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every comparison with a task name: `x == "embed"`, `x in ("embed", ...)`,
    `match x: case "embed"`."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            values = operands + [e for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set)) for e in o.elts]
            hits += [(node.lineno, v.value) for v in values if isinstance(v, ast.Constant) and v.value in TASK_NAMES]
        elif isinstance(node, ast.MatchValue) and isinstance(node.value, ast.Constant) \
                and node.value.value in TASK_NAMES:
            hits.append((node.lineno, node.value.value))
    return hits


def test_only_tasks_branch_on_the_task_name() -> None:
    found = [f"{m}:{line} compares with task {name!r}" for m, path in module_files(ROOT, "batchinf").items()
             if not m.startswith("batchinf.tasks") for line, name in _branches(ast.parse(path.read_text()))]
    assert not found, "branch on the task outside batchinf/tasks/ (ask the task instead):\n" + "\n".join(found)


def test_the_boundary_check_sees_a_branch() -> None:
    """The check itself can fail: each form of branch is found."""
    src = 'if job.task == "generate": pass\nif t in ("embed", "x"): pass\nmatch t:\n    case "embed": pass\n'
    assert [name for _, name in _branches(ast.parse(src))] == ["generate", "embed", "embed"]


def test_every_task_implements_the_protocol() -> None:
    for name, task in TASKS.items():
        assert task.name == name
        for method in ("stage", "run", "result_schema", "build_meta", "open_runtime", "verify_model", "detects"):
            assert getattr(type(task), method) is not getattr(type(task).__mro__[-2], method), (name, method)
